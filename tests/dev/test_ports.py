"""The loopback ports the tests and the load runs give their servers: never one port twice."""

from __future__ import annotations

import socket

from kev_backend.dev.ports import free_port


def test_no_port_is_handed_out_twice() -> None:
    # Closed at once, a bound port goes back to the kernel's pool: without the record of ports handed out, 3,000 binds
    # to port 0 repeated a port about 280 times (Linux 6).
    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)


def test_a_handed_out_port_can_be_listened_on() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen()
