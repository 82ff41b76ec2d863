"""What the worker pool and its worker processes say to each other, over a ``multiprocessing``
pipe (pickled: both ends are this server's own processes, never a network peer).

The pool sends a ``Task``, or ``None`` to ask a worker to exit. A worker says ``Ready`` once it
has its copy of the source (or ``SetupFailed``), then answers each task with one of ``Done``
(the arrays written to the task's hand-off file), ``Inline`` (the arrays themselves, where the
file could not be written) or ``Failed``; each answer carries the source counters' increments
since the worker's last answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

import numpy as np

__all__ = ["Task", "Ready", "SetupFailed", "Done", "Inline", "Failed", "Answer", "FromWorker"]


@dataclass(frozen=True)
class Task:
    """Decode ``unit`` of ``split`` (``columns`` of it) and write it to ``path`` (None: no file)."""

    id: int
    split: str
    unit: int
    columns: Sequence[Any]
    path: str | None


@dataclass(frozen=True)
class Ready:
    """The worker has its copy of the source."""


@dataclass(frozen=True)
class SetupFailed:
    """The worker could not make its copy of the source."""

    traceback: str


@dataclass(frozen=True)
class Done:
    """The task's arrays are in its hand-off file (``written`` False: they were all empty)."""

    task_id: int
    written: bool
    layout: Any
    counts: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Inline:
    """The task's arrays themselves: its file could not be written (``why``)."""

    task_id: int
    arrays: dict[str, np.ndarray]
    why: str
    counts: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Failed:
    """Decoding raised: a DataError (bad data, named) or anything else (a bug, with its traceback)."""

    task_id: int
    data_error: bool
    message: str
    type_name: str
    traceback: str
    counts: Mapping[str, int] = field(default_factory=dict)


Answer = Union[Done, Inline, Failed]
FromWorker = Union[Ready, SetupFailed, Done, Inline, Failed]
