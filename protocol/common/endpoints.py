"""HOST:PORT as people write it, and the ZeroMQ endpoint it names."""

from __future__ import annotations

__all__ = ["parse_host_port", "tcp_endpoint"]


def parse_host_port(text: str) -> tuple[str, int]:
    """``"host:5557"``, ``"[::1]:5557"`` or ``"::1:5557"`` as (host, port).

    Raises:
        ValueError: not HOST:PORT with a port in 1..65535; the message quotes the text.
    """
    host, _, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {text!r} is not HOST:PORT")
    return host, int(port)


def tcp_endpoint(text: str) -> str:
    """The ``tcp://`` endpoint of HOST:PORT, with an IPv6 host in brackets."""
    host, port = parse_host_port(text)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
