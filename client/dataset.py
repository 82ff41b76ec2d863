"""``ServerDataset``: a rank's share of a data server as a torch ``IterableDataset``, for
``DataLoader(ds, batch_size=None)`` and torchdata's ``StatefulDataLoader``. Importing this module
imports torch; ``fuelline.client`` imports it only when ``ServerDataset`` is first named.

Use ``num_workers=0``: the data server is already the worker, reading and batching ahead in
processes of its own. A DataLoader worker adds a hop (each batch copied into shared memory for
the DataLoader's queue and mapped again in the main process): on one served table, 2 workers read
a quarter of the rows/s of ``num_workers=0`` at three times the CPU per row. Workers are still
served correctly, as below.

Workers. Worker w of K reads a contiguous run of the rank's own batches: of the rank's B batches
per epoch, runs of B // K, the first B % K workers one batch more, in worker order. The batches are
the ones a single reader of the rank gets, whatever K: ``len()`` is the rank's batches per epoch,
and an epoch is every row of the rank's share once. (Reading as rank ``rank·K + w`` of
``world_size·K`` would not do: the server pads each world size on its own, so those spans cover
the rank's share only where K divides it, and otherwise reach into the next rank's rows.) Each
worker has its own connection, made at its first batch and closed at the end of its run; up to
``hwm`` batches past the run may already be on their way then, and are dropped.

Epochs. Every iterator is the next epoch. Non-persistent workers are new processes every epoch,
copies of the main process's dataset, so the count cannot live in a worker: it lives in shared
memory, one slot per worker, which each worker advances as it starts an epoch. Persistent workers,
and the main process with ``num_workers=0``, use the same slots. ``set_epoch(e)`` sets them all,
as ``DistributedSampler.set_epoch`` does: the next iterator serves epoch e.

Devices. ``device=`` and ``pin_memory=`` (as ``ServerDataStream``'s) place batches in the process
that iterates the dataset, which with ``num_workers > 0`` is a worker: CUDA there would be a CUDA
context per worker, and pinned memory does not survive the trip to the main process. So they are
refused in a worker; with workers, leave them unset, pass ``pin_memory=True`` to the DataLoader
(which pins in the main process) and move each batch with ``.to(device, non_blocking=True)`` in
the loop. With ``num_workers=0``, ``device="cuda"`` hands over batches already on the GPU (then
the DataLoader's own ``pin_memory`` must stay False: it pins CPU tensors only).

Checkpoints. ``state_dict()`` is the position of this process's newest iterator (in a worker, in
its own run); ``load_state_dict()`` makes the next iterator continue it. StatefulDataLoader saves
and restores it in each worker, so a resumed epoch is every remaining row once.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from dataclasses import dataclass
from multiprocessing import context as mp_context
from typing import Any, Iterator, Mapping, Sequence

from torch.utils.data import IterableDataset, default_collate, get_worker_info

from fuelline.client.stream import ServerDataStream
from fuelline.protocol import ProtocolError

__all__ = ["DATASET_STATE_FORMAT", "MAX_WORKERS", "ServerDataset", "worker_run"]

DATASET_STATE_FORMAT = 1
MAX_WORKERS = 1024  # DataLoader workers a dataset can count epochs for (slots of shared memory)


def worker_run(batches: int, worker: int, workers: int) -> tuple[int, int]:
    """``(first, count)``: the run of an epoch's ``batches`` that worker ``worker`` of ``workers`` reads."""
    base, extra = divmod(batches, workers)
    return worker * base + min(worker, extra), base + (worker < extra)


@dataclass
class _Position:
    """Where this process's newest iterator is: ``done`` batches of its run of ``epoch``."""

    epoch: int
    done: int
    worker: int | None
    workers: int


class ServerDataset(IterableDataset):
    """A rank's share of a data server's epochs, as a torch ``IterableDataset``.

    Takes ``ServerDataStream``'s arguments (``rank`` and ``world_size`` default to torchrun's
    ``RANK`` / ``WORLD_SIZE``). Use it with ``batch_size=None``: the server batches. Each
    iterator is the next epoch; ``set_epoch(e)`` picks one. The dataset pickles without
    connections (spawned workers connect on their own), and ``state_dict()`` /
    ``load_state_dict()`` resume an epoch, as torchdata's ``StatefulDataLoader`` does per worker.
    A ``context`` given is not carried into other processes.

    Args:
        sources: the sources to read, as ``ServerDataStream``'s (None: every source).
        *args: ``ServerDataStream``'s other arguments, in its order.
        as_dict: yield dicts by source name instead of tuples in ``sources`` order.
        **kwargs: ``ServerDataStream``'s keyword arguments, ``device`` and ``pin_memory``
            included (with ``num_workers=0`` only: see the module's docstring).

    Raises:
        ValueError, TypeError: arguments ``ServerDataStream`` refuses; ``device`` or
            ``pin_memory`` in a DataLoader worker (when it iterates).
    """

    def __init__(self, sources: Sequence[str] | None = None, *args: Any, as_dict: bool = False, **kwargs: Any) -> None:
        template = ServerDataStream(sources, *args, **kwargs)  # checks the arguments; connects nothing
        self.rank, self.world_size, self.split = template.rank, template.world_size, template.split
        self.as_dict = as_dict
        # The rank and world size fixed now: a worker's environment may say otherwise.
        self._config = {**template._config, "context": None, "rank": self.rank, "world_size": self.world_size}
        self._epochs = multiprocessing.RawArray("q", MAX_WORKERS)  # the next epoch, per worker
        self._batches: int | None = None  # per epoch, once a server said
        self._fingerprint: dict[str, str] | None = None
        self._reader: ServerDataStream | None = None
        self._reader_pid = 0
        self._resume: tuple[int, int] | None = None  # (epoch, done) loaded for the next iterator
        self._position: _Position | None = None

    # -- torch's interface -----------------------------------------------------------------------
    def __len__(self) -> int:
        """This rank's batches per epoch (asks the server once)."""
        if self._batches is None:
            # A connection of its own with a fresh client id and the smallest prefetch.
            with ServerDataStream(**{**self._config, "client_id": None, "hwm": 1}) as probe:
                self._note_batches(probe.batches_per_epoch)
        if self._batches is None:
            raise TypeError("len() of a ServerDataset: the server cannot say how many batches an epoch has "
                            "(it serves a Fuel-style stream)")
        return self._batches

    def __iter__(self) -> Iterator[Any]:
        _refuse_automatic_batching(self, sys._getframe(1))  # (torch may wrap __iter__: its caller's callers too)
        worker, workers = _worker()
        device, pin_memory = self._config.get("device"), self._config.get("pin_memory")
        if worker is not None and (device is not None or pin_memory):
            raise ValueError(
                f"ServerDataset(device={device!r}, pin_memory={pin_memory!r}) places batches in the process that "
                f"iterates it, here DataLoader worker {worker} of num_workers={workers}: use num_workers=0, or "
                "leave device and pin_memory unset, pass pin_memory=True to the DataLoader and move each batch "
                "with .to(device, non_blocking=True) in the loop")
        if self._resume is not None:
            (epoch, done), self._resume = self._resume, None
        else:
            epoch, done = self._epochs[worker or 0], 0
        # This worker's next iterator (every worker's, in the main process) is the next epoch.
        if worker is None:
            self._epochs[:] = [epoch + 1] * MAX_WORKERS
        else:
            self._epochs[worker] = epoch + 1
        position = self._position = _Position(epoch, done, worker, workers)
        return self._read(position)

    def set_epoch(self, epoch: int) -> None:
        """Serve epoch ``epoch`` on the next iterator, in every worker (later ones follow it).
        A position loaded by ``load_state_dict`` still comes first."""
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"set_epoch: epoch must be an int >= 0, got {epoch!r}")
        self._epochs[:] = [epoch] * MAX_WORKERS

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position of this process's newest iterator: its epoch and the batches of its run
        handed out (in a DataLoader worker, its own run)."""
        if self._position is None:
            worker, workers = _worker()
            position = _Position(self._epochs[worker or 0], 0, worker, workers)
        else:
            position = self._position
        return {
            "format": DATASET_STATE_FORMAT, "epoch": position.epoch, "batches": position.done,
            "worker": position.worker, "workers": position.workers, "rank": self.rank,
            "world_size": self.world_size, "split": self.split,
            "fingerprint": None if self._fingerprint is None else dict(self._fingerprint),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a ``state_dict()`` on the next iterator: the rest of its run of its epoch.

        Raises:
            ValueError: another format, rank, world size, split or number of workers (the message
                names the field), or an invalid position.
        """
        if state.get("format") != DATASET_STATE_FORMAT:
            raise ValueError(f"ServerDataset state format {state.get('format')!r} is not {DATASET_STATE_FORMAT}")
        worker, workers = _worker()
        mine = {"rank": self.rank, "world_size": self.world_size, "split": self.split, "workers": workers,
                "worker": worker}
        for field, value in mine.items():
            if state.get(field) != value:
                raise ValueError(f"ServerDataset state was saved with {field}={state.get(field)!r}, "
                                 f"this one has {field}={value!r}")
        epoch, done = state.get("epoch"), state.get("batches")
        if type(epoch) is not int or type(done) is not int or epoch < 0 or done < 0:
            raise ValueError(f"ServerDataset state has an invalid position epoch={epoch!r} batches={done!r}")
        if state.get("fingerprint") is not None:
            self._fingerprint = dict(state["fingerprint"])
        self._resume = (epoch, done)
        self._position = _Position(epoch, done, worker, workers)

    # -- pickling --------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_reader"], state["_reader_pid"] = None, 0
        if mp_context.get_spawning_popen() is None:
            # Pickled to be kept, not to start a worker process: the epoch counts as numbers.
            state["_epochs"] = list(self._epochs)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["_epochs"], list):
            epochs = multiprocessing.RawArray("q", MAX_WORKERS)
            epochs[:] = state["_epochs"]
            state["_epochs"] = epochs
        self.__dict__.update(state)

    # -- internals -------------------------------------------------------------------------------
    def _note_batches(self, batches: int | None) -> None:
        if batches is not None:
            self._batches = batches

    def _connect(self, worker: int | None) -> ServerDataStream:
        if self._reader is not None and self._reader_pid == os.getpid():
            return self._reader
        # (A reader copied in by fork belongs to the parent's sockets and threads: it is left alone.)
        client_id = self._config.get("client_id")
        if client_id is not None and worker is not None:
            # The server replaces a session whose client id connects again: one id per worker.
            client_id = f"{client_id}/worker{worker}"
        self._reader = ServerDataStream(**{**self._config, "client_id": client_id})
        self._reader_pid = os.getpid()
        return self._reader

    def _seek(self, reader: ServerDataStream, epoch: int, cursor: int) -> None:
        state = reader.state_dict()
        state.update(epoch=epoch, cursor=cursor, history=[])
        if state["fingerprint"] is None and self._fingerprint is not None:
            state["fingerprint"] = self._fingerprint  # a resumed position holds to its sequence
        reader.load_state_dict(state)

    def _read(self, position: _Position) -> Iterator[Any]:
        reader = self._connect(position.worker)
        try:
            if self._batches is None:
                # Worker 0's run starts there: the others drop what arrives before they seek.
                self._seek(reader, position.epoch, 0)
                self._note_batches(reader.batches_per_epoch)
            if self._batches is None:
                if position.workers > 1:
                    raise ValueError("a ServerDataset over a Fuel-style stream (which cannot say how many batches "
                                     "an epoch has) cannot be split among DataLoader workers; use num_workers <= 1")
                first, count = 0, None
            else:
                first, count = worker_run(self._batches, position.worker or 0, position.workers)
            self._seek(reader, position.epoch, first + position.done)
            batches = reader.get_epoch_iterator(as_dict=self.as_dict)
            while count is None or position.done < count:
                batch = next(batches, None)
                if batch is None:
                    if count is None:
                        return
                    raise ProtocolError(f"the server ended epoch {position.epoch} after {first + position.done} "
                                       f"batches; it said an epoch has {self._batches}")
                position.done += 1
                if self._fingerprint is None:
                    self._fingerprint = reader.state_dict()["fingerprint"]
                yield batch
        finally:
            reader.close()
            if self._reader is reader:
                self._reader = None


def _refuse_automatic_batching(dataset: ServerDataset, caller: Any) -> None:
    """Refuse a DataLoader that batches the served batches again with its default collation.

    ``DataLoader(ds)`` leaves ``batch_size=1``: it would take each served batch as one sample
    and stack it into a batch of one, every array one dimension deeper ([1, B, ...]), which
    trains on the wrong shapes without an error. torch's fetcher (also torchdata's
    StatefulDataLoader's) makes the iterator and says whether it batches; a collate_fn of the
    user's own is taken to mean it on purpose.
    """
    for _ in range(4):
        if caller is None:
            return
        fetcher = caller.f_locals.get("self")
        if getattr(fetcher, "dataset", None) is dataset:
            break
        caller = caller.f_back
    else:
        return
    if getattr(fetcher, "auto_collation", False) and getattr(fetcher, "collate_fn", None) is default_collate:
        raise ValueError(
            "DataLoader(ServerDataset(...)) batches what it reads, but the server already sends batches: "
            "each would become a batch of one, every array one dimension deeper ([1, B, ...]). "
            "Pass batch_size=None: DataLoader(dataset, batch_size=None)")


def _worker() -> tuple[int | None, int]:
    """This process's DataLoader worker id and the number of workers; (None, 1) outside one."""
    info = get_worker_info()
    if info is None:
        return None, 1
    if info.num_workers > MAX_WORKERS:
        raise ValueError(f"a ServerDataset counts epochs for at most {MAX_WORKERS} DataLoader workers, "
                         f"got num_workers={info.num_workers}")
    return info.id, info.num_workers
