"""The ``fuelline`` command line: one module per command, and the generated CLI reference."""

from fuelline.server.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
