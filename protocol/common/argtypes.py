"""argparse types shared by the ``fuelline`` commands and the trainer: each names the rule it
checks, and argparse adds the option's name to the message."""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

__all__ = [
    "checked", "fraction", "positive_int", "non_negative_int", "seconds", "non_negative_float", "host_port", "port",
    "listen_port",
]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"must be in (0, 3600] seconds, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def host_port(text: str) -> str:
    """HOST:PORT, returned as given (stripped)."""
    from fuelline.protocol.common.endpoints import parse_host_port

    try:
        parse_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def _port(text: str, free: bool) -> int:
    from fuelline.protocol.common.ports import check_port

    try:
        return check_port(text, "port", free=free)
    except ValueError as exc:  # (OptionError: argparse names the option itself)
        raise argparse.ArgumentTypeError(getattr(exc, "rule", str(exc))) from None


def port(text: str) -> int:
    """A TCP port to connect to: 1..65535."""
    return _port(text, free=False)


def listen_port(text: str) -> int:
    """A TCP port to listen on: 1..65535, or 0 for a free one."""
    return _port(text, free=True)


def fraction(text: str) -> float:
    """A share in [0, 1)."""
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def checked(convert: Callable[[str], Any], ok: Callable[[Any], bool], need: str) -> Callable[[str], Any]:
    """A type that converts with ``convert``, then rejects values for which ``ok`` is false,
    saying what is needed (``need``, e.g. ``">= 1"``)."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {need}, got {text}")
        return value

    return parse
