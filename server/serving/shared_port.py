"""One TCP port shared by several serving processes (``fuelline serve --processes N``).

Each serving process listens on the port with ``SO_REUSEPORT``, and the kernel hands every new
connection to one of them (by a hash of the connection's addresses: spread, not balanced). The
process that starts them holds the port too, bound but not listening, so that it stays theirs
while one of them restarts; a socket that does not listen is never handed a connection.

Only sockets of the same user may join a port this way: another user's process cannot bind it,
and the port of a single serving process (``--processes 1``) is not shared at all.
"""

from __future__ import annotations

import socket

__all__ = ["shared_port_socket"]

BACKLOG = 128


def shared_port_socket(host: str, port: int, *, listen: bool, first: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (port 0 picks a free one),
    listening if ``listen``.

    ``first``: the port must be free, not merely shared. A socket of another server of this user
    that shares its port would let this one in, and the kernel would hand this server's clients
    to both; so the port is first bound without sharing, which fails if anyone holds it.

    Raises:
        OSError: the port is taken (by a socket that does not share it; with ``first``, by any),
            or this system has no ``SO_REUSEPORT``.
    """
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("this system cannot share a port between processes (no SO_REUSEPORT)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if first and port != 0:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, port))  # (EADDRINUSE while any socket, sharing or not, holds it)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock
