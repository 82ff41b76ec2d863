"""The peers benchmark's figure: one panel per figure (rows/s or windows/s, CPU per 1,000 over the
timed span and over the whole pass, peak memory, time to the first batch from the reader's start
and from the start of everything, batch mix), bars at the median with the min–max of the rounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import plots

__all__ = ["draw"]

def draw(record: dict[str, Any], results_dir: Path, name: str = "peers") -> Path:
    """``<name>.png``: a panel per figure of the record (MB/s left out: the rate's panel has it)."""
    panels = [unit for unit in record["metrics"] if unit != "MB/s"]
    width = max(6.0, 1.1 * len(record["contenders"]))
    fig, axes = plots.plt.subplots(2, 4, figsize=(4 * width, 9.5), squeeze=False)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    for ax, unit in zip(axes.flat, panels):
        plots._bars(ax, record, unit)
        ax.set_title(unit, fontsize=9)
        ax.tick_params(axis="x", labelsize=6)
    title = record.get("title", name)
    if record.get("not_run"):
        title += "\nnot run: " + "; ".join(f"{k}" for k in record["not_run"])
    fig.suptitle(title, fontsize=10)
    return plots._save(fig, results_dir / f"{name}.png")
