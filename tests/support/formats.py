"""Converted datasets as earlier versions of fuelline wrote them, for the tests of upgrading."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["strip_grids"]


def strip_grids(dataset: Path, fmt: str) -> None:
    """Make a converted dataset, in place, what ``fmt`` (format 1 or 2) was: no grid files, and
    a manifest of that format without the placements' grid fields."""
    manifest = json.loads((dataset / "manifest.json").read_text())
    manifest["format"] = fmt
    for r in manifest["recordings"]:
        for p in r["modalities"].values():
            del p["grid_file"], p["grid_points"], p["zgrid_file"]
    (dataset / "manifest.json").write_text(json.dumps(manifest))
    for grid in dataset.glob("*/*grid-*.arrow"):
        grid.unlink()
