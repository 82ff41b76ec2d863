"""The installed version of fuelline, as ``--version`` prints it for every command (``fuelline``
and the trainer), which share no parser."""

from __future__ import annotations

__all__ = ["installed_version", "version_line"]


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fuelline")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def version_line() -> str:
    """What ``--version`` prints: ``fuelline 0.1.0``."""
    return f"fuelline {installed_version()}"
