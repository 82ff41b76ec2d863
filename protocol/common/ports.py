"""TCP ports as people and callers give them: the one range check behind every option, argument
and endpoint that takes a port.

libzmq reads an endpoint's port as 16 bits, so ``--port 70000`` would listen on 4464 while the
server said 70000; Python's sockets raise OverflowError. So a port outside 1..65535 (0 where it
means "pick a free one") is refused where it is given, naming the option and the value.
"""

from __future__ import annotations

import operator

from fuelline.protocol.errors import OptionError

__all__ = ["MAX_PORT", "check_port", "port_rule"]

MAX_PORT = 65535


def _number(value: object) -> int | None:
    """``value`` as an integer: any integer type (numpy's too) or a string of digits, as Fuel
    took a port (it only ever put it into an endpoint string); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        return int(text) if text.isascii() and text.isdigit() else None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def port_rule(value: object, *, free: bool = False) -> str | None:
    """What is wrong with ``value`` as a port (``"must be ..., got ..."``), or None if nothing is.

    Args:
        free: 0 is allowed, meaning "pick a free port" (a server's own port; never one to connect to).
    """
    low = 0 if free else 1
    need = f"a TCP port in {low}..{MAX_PORT}" + (" (0 picks a free one)" if free else "")
    number = _number(value)
    if number is None:
        return f"must be {need}, got {value!r}"
    if not low <= number <= MAX_PORT:
        return f"must be {need}, got {number}"
    return None


def check_port(value: object, name: str, *, free: bool = False) -> int:
    """``value`` as a port number.

    Args:
        name: how the message names the argument (``port``, ``metrics_port``).
        free: 0 is allowed and means "pick a free port".

    Raises:
        OptionError: not an integer in 1..65535 (0..65535 with ``free``); names ``name`` and the value.
    """
    rule = port_rule(value, free=free)
    if rule is not None:
        raise OptionError(name, rule)
    number = _number(value)
    assert number is not None  # (port_rule said it is one)
    return number
