"""Free loopback ports for servers a test or a load run starts itself."""

from __future__ import annotations

import socket

# Every port handed out by this process. The kernel may give the same free port to two binds in a row once the first
# socket is closed, and a port handed out is only bound later, by the server it is for: two servers (or one server's
# HTTP, gRPC and metrics ports) were given one port, and tritonserver refused to start.
_issued: set[int] = set()


def free_port() -> int:
    """A loopback port free now and never handed out before by this process."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _issued:
            _issued.add(port)
            return port
