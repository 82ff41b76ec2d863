"""Checkpoints: model, optimizer, compression state, loss weighting and data position, per rank.

Every rank writes its own file at the same step (the ranks step in lockstep: the data servers
give each the same number of batches); once all have, rank 0 records the step in ``latest.json``.
A crash while writing leaves the previous checkpoint as the latest. Each file is written to a
temporary name, flushed to disk and renamed, and the folder is flushed after the rename, so none
is ever half-written, not even after a power cut.

A checkpoint folder is often a shared volume, so loading one must not run code: files are loaded
with ``torch.load(weights_only=True)``, which accepts tensors and plain containers, numbers and
strings only. :func:`plain` makes a state of that kind before it is saved.

One job writes a folder at a time: rank 0 holds an exclusive lock on ``<folder>/.lock`` (an
``flock``, released by the kernel when the process ends, however it ends) for as long as the job
runs, and a second job's rank 0 is refused, naming the holder's process and host. A ``--resume``
started while the job it resumes still runs would otherwise write the same steps beside it.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import re
import socket
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from fuelline.protocol.errors import CheckpointError

__all__ = ["CheckpointError", "Checkpoints", "plain"]


def plain(value: Any, where: str = "state") -> Any:
    """``value`` with numpy arrays as tensors and numpy scalars as numbers, checked to hold only
    tensors, dicts, lists, tuples, numbers, strings and None, so that ``weights_only`` loading
    accepts it. Containers with nothing to convert are returned as they are (a module's
    ``state_dict`` keeps its metadata).

    Raises:
        TypeError: some value is of another kind; the message says where in ``value`` it is.
    """
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        items = {}
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}, not a str or int")
            items[key] = plain(item, f"{where}[{key!r}]")
        if all(items[k] is value[k] for k in items):
            return value
        return dict(items)
    if isinstance(value, (list, tuple)):
        elements = [plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
        if all(new is old for new, old in zip(elements, value)):
            return value
        return type(value)(elements) if type(value) in (list, tuple) else elements
    raise TypeError(f"{where} is a {type(value).__name__}, which a checkpoint cannot hold "
                    "(tensors, dicts, lists, numbers and strings only)")


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Write ``path`` through a temporary file: data on disk before the rename, rename on disk after."""
    tmp = f"{path}.tmp"
    with open(tmp, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


class Checkpoints:
    KEEP = 2

    LOCK = ".lock"

    def __init__(self, directory: str, rank: int, world_size: int) -> None:
        """Raises:
            CheckpointError: (rank 0) another job holds the folder."""
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        os.makedirs(directory, exist_ok=True)
        self._lock_fd: int | None = self._lock() if rank == 0 else None

    def _lock(self) -> int:
        path = os.path.join(self.directory, self.LOCK)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CheckpointError(f"checkpoint folder {self.directory} is in use by {holder}: one job writes a folder "
                                  "at a time; wait for that job to end (or stop it), or give another --checkpoint-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                  .encode(), 0)
        return fd

    def close(self) -> None:
        """Release the folder (the process's end releases it too)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _path(self, step: int, rank: int) -> str:
        return os.path.join(self.directory, f"step{step:09d}-rank{rank}.pt")

    def save(self, step: int, state: dict[str, Any]) -> None:
        state = plain(state)
        _write_durably(self._path(step, self.rank), lambda f: torch.save(state, f))
        if dist.is_initialized():
            dist.barrier()
        if self.rank == 0:
            meta = {"step": step, "world_size": self.world_size}
            _write_durably(os.path.join(self.directory, "latest.json"), lambda f: json.dump(meta, f), "w")
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
        ``"resized"`` says so: what is per rank (compression error buffers) no longer applies.

        Raises:
            CheckpointError: ``latest.json`` or the checkpoint file is unreadable, or the file
                holds anything but plain data (a pickled object would run code as it loads).
        """
        latest = os.path.join(self.directory, "latest.json")
        if not os.path.exists(latest):
            return None
        try:
            with open(latest) as f:
                meta = json.load(f)
            step, old = int(meta["step"]), int(meta["world_size"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{latest}: not a readable checkpoint record ({exc})") from None
        path = self._path(step, self.rank % old)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            # torch's message is advice on loading the file anyway; keep only what it found.
            found = re.search(r"Unsupported global: (?:GLOBAL )?(\S+)", str(exc))
            what = f"it names {found.group(1)}" if found else "it is not plain data"
            raise CheckpointError(
                f"{path}: refused to load: {what}, and a checkpoint may hold only tensors, dicts, lists, "
                "numbers and strings (loading anything else would run code from the file)") from None
        except (OSError, RuntimeError, EOFError) as exc:
            raise CheckpointError(f"{path}: cannot load checkpoint ({exc})") from None
        state["resized"] = old != self.world_size
        return state
