"""Checkpoints: model, optimizer, compression state, loss weighting and data position, per rank.

Every rank writes its own file at the same step (the ranks step in lockstep: the data servers
give each the same number of batches); once all have, rank 0 records the step in ``latest.json``.
A crash while writing leaves the previous checkpoint as the latest. Each file is written to a
temporary name and renamed, so none is ever half-written.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Checkpoints"]


class Checkpoints:
    KEEP = 2

    def __init__(self, directory: str, rank: int, world_size: int) -> None:
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        os.makedirs(directory, exist_ok=True)

    def _path(self, step: int, rank: int) -> str:
        return os.path.join(self.directory, f"step{step:09d}-rank{rank}.pt")

    def save(self, step: int, state: dict[str, Any]) -> None:
        path = self._path(step, self.rank)
        tmp = f"{path}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)
        if dist.is_initialized():
            dist.barrier()
        if self.rank == 0:
            latest = os.path.join(self.directory, "latest.json")
            with open(f"{latest}.tmp", "w") as f:
                json.dump({"step": step, "world_size": self.world_size}, f)
            os.replace(f"{latest}.tmp", latest)
        self._prune(step)

    def _prune(self, newest: int) -> None:
        mine = sorted(
            int(name[4:13]) for name in os.listdir(self.directory)
            if name.startswith("step") and name.endswith(f"-rank{self.rank}.pt")
        )
        for step in mine[: -self.KEEP]:
            if step != newest:
                os.remove(self._path(step, self.rank))

    def load_latest(self) -> dict[str, Any] | None:
        """This rank's state of the latest checkpoint. From a run of another world size, any old
        rank's file serves (model, optimizer and data position are the same on every rank), and
        ``"resized"`` says so: what is per rank (compression error buffers) no longer applies."""
        latest = os.path.join(self.directory, "latest.json")
        if not os.path.exists(latest):
            return None
        with open(latest) as f:
            meta = json.load(f)
        old = int(meta["world_size"])
        state = torch.load(self._path(meta["step"], self.rank % old), weights_only=False)
        state["resized"] = old != self.world_size
        return state
