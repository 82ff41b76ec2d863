"""The ingest subcommands of ``fuelline``: ``synth`` and ``convert``.

Each module registers its own subparser here, so ``fuelline.server.cli`` stays a thin dispatcher.
"""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add the ingest subcommands; each sets ``func`` (args -> exit status) as its default."""
    from fuelline.server.ingest import convert, synth

    synth.register(sub)
    convert.register(sub)
