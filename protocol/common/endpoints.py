"""HOST:PORT as people write it, the ZeroMQ endpoint it names, and the line a server prints
once it accepts clients (``serving on tcp://HOST:PORT``), which launchers and tests wait for."""

from __future__ import annotations

import re

from fuelline.protocol.common.ports import MAX_PORT
from fuelline.protocol.errors import OptionError

__all__ = ["parse_host_port", "tcp_endpoint", "ready_line", "parse_ready_line"]

_READY = re.compile(r"serving on tcp://(\[[^\]]+\]|[^\s\[\]]+):(\d+)")


def parse_host_port(text: str, what: str = "endpoint") -> tuple[str, int]:
    """``"host:5557"``, ``"[::1]:5557"`` or ``"::1:5557"`` as (host, port).

    Args:
        what: how the message names where the text came from (``endpoint``, ``--servers``).

    Raises:
        OptionError: (a ValueError) not HOST:PORT, or a port outside 1..65535; the message
            names ``what`` and quotes the text.
    """
    host, _, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not host or not port.isascii() or not port.isdigit():
        raise OptionError(what, f"{text!r} is not HOST:PORT")
    if not 0 < int(port) <= MAX_PORT:
        raise OptionError(what, f"{text!r} has port {int(port)}; a port must be in 1..{MAX_PORT}")
    return host, int(port)


def tcp_endpoint(text: str, what: str = "endpoint") -> str:
    """The ``tcp://`` endpoint of HOST:PORT, with an IPv6 host in brackets (errors as ``parse_host_port``)."""
    host, port = parse_host_port(text, what)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def ready_line(endpoint: str) -> str:
    """What a server prints on stdout once it accepts clients at ``endpoint`` (``tcp://…``)."""
    return f"serving on {endpoint}"


def parse_ready_line(line: str) -> tuple[str, int] | None:
    """(host, port) of a server's ready line (an IPv6 host without its brackets), else None."""
    match = _READY.match(line.strip())
    if match is None:
        return None
    return match.group(1).strip("[]"), int(match.group(2))
