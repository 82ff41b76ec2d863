"""The peers benchmark's figure: one panel per figure (rows/s, CPU per 1,000 rows over the timed
span and over the whole pass, peak memory, time to the first batch from the reader's start and
from the start of everything, batch mix), bars at the median with the min–max of the rounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import plots

__all__ = ["draw"]

PANELS = ("rows/s", "CPU s/1k rows", "CPU s/1k rows, whole pass", "peak MB", "s to first batch",
          "s to first batch, from start", "row groups/batch")


def draw(record: dict[str, Any], results_dir: Path, name: str = "peers") -> Path:
    width = max(6.0, 1.1 * len(record["contenders"]))
    fig, axes = plots.plt.subplots(2, 4, figsize=(4 * width, 9.5), squeeze=False)
    for ax in list(axes.flat)[len(PANELS):]:
        ax.set_visible(False)
    for ax, unit in zip(axes.flat, PANELS):
        plots._bars(ax, record, unit)
        ax.set_title(unit, fontsize=9)
        ax.tick_params(axis="x", labelsize=6)
    title = record.get("title", name)
    if record.get("not_run"):
        title += "\nnot run: " + "; ".join(f"{k}" for k in record["not_run"])
    fig.suptitle(title, fontsize=10)
    return plots._save(fig, results_dir / f"{name}.png")
