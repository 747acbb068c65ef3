"""The ports a start will bind, checked before anything is started.

Another server on one of them (a second `make serve`, an earlier one not stopped) would otherwise make tritonserver
exit at each start with a bind error while the other server's port answers the readiness check: a crash loop that
looks ready. The check binds each port on its address (with SO_REUSEADDR, so a port a stopped server left in
TIME_WAIT passes) and lets it go at once.
"""

from __future__ import annotations

import errno
import socket

from ...settings import ServeSettings


def wanted_ports(config: ServeSettings) -> list[tuple[str, int, str]]:
    """(address, port, the setting that names the port) for every port this start binds."""
    ports = [
        (config.triton_address, config.http_port, "HTTP_PORT"),
        (config.triton_address, config.grpc_port, "GRPC_PORT"),
        (config.triton_address, config.metrics_port, "METRICS_PORT"),
    ]
    if config.gateway:
        ports.append((config.bind_address, config.gateway_port, "GATEWAY_PORT"))
    return ports


def bind_error(address: str, port: int) -> str | None:
    """Why a server could not bind `address:port` ("in use" where another socket listens there); None if it can."""
    try:
        for family, kind, proto, _, where in socket.getaddrinfo(
            address or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(where)
    except OSError as error:
        return "in use" if error.errno == errno.EADDRINUSE else error.strerror or str(error)
    return None


def taken_ports(config: ServeSettings) -> str | None:
    """What to say when a port this start needs cannot be bound (None: all can)."""
    taken = [
        f"{address}:{port} ({name}): {why}"
        for address, port, name in wanted_ports(config)
        if (why := bind_error(address, port)) is not None
    ]
    if not taken:
        return None
    return (
        f"cannot bind {'; '.join(taken)}. Stop the process holding it (another kev-serve or tritonserver still "
        "running?), or choose other ports or addresses (HTTP_PORT, GRPC_PORT, METRICS_PORT, GATEWAY_PORT, "
        "TRITON_ADDRESS, BIND_ADDRESS)"
    )
