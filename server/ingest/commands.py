"""The ingest subcommands of ``fuelline``: ``synth`` and ``convert``.

Each module registers its own subparser here, so ``fuelline.server.cli`` stays a thin dispatcher.
"""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add the ingest subcommands; each sets ``func`` (args -> exit status) as its default."""
    for name in ("synth", "convert"):
        try:
            module = __import__(f"fuelline.server.ingest.{name}", fromlist=["register"])
        except ModuleNotFoundError as exc:
            if exc.name != f"fuelline.server.ingest.{name}":
                raise
            continue  # not built yet
        module.register(sub)
