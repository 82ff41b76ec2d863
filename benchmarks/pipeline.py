"""Pipeline: aligned AMIGOS windows per second delivered to a consumer, fuelline against the
ways a training script could get the same windows without a data server.

Data: ``fuelline synth`` recordings converted once with ``fuelline convert`` (cached under the
data directory). Every contender delivers the same thing: every window of the train split, once
per round, in batches, all seven sources, aligned, z-scored and shuffled across recordings in
blocks of 8 recordings. Contenders, alternately:

- fuelline serve: a ``fuelline serve`` process read through ``ServerDataStream``;
- in-process: ``WindowSource.iter_batches`` in the consumer's own process (read-ahead threads);
- DataLoader, num_workers 0/1/2: a PyTorch ``DataLoader`` over an ``IterableDataset`` that decodes
  recordings with fuelline's own code (``WindowSource.windows``: read, align, window,
  normalise), mixes a block of recordings, and yields ready batches (``batch_size=None``: no
  per-sample collation); the source is built in each worker (``worker_init_fn``), workers persist
  across rounds, blocks are dealt to workers round-robin, pin_memory off (CPU).

With ``--before REV``, also: fuelline serve as revision REV serves the same dataset, and both with a
user stage (``--stage fuelline.server.multimodal.stages:band_power``), for before and after in one run.

The comparison is therefore about delivery (processes, threads, queues, sockets), not about the
alignment arithmetic, which is the same code everywhere. The reference is the 980 windows/s of
the Arrow pipeline this work started from.
"""

from __future__ import annotations

import gc
import itertools
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from benchmarks.common import (
    RESULTS_DIR,
    Contender,
    Round,
    ServerProcess,
    SourceTree,
    alternate,
    progress,
    time_batches,
)
from benchmarks.report import Metric, RatioSpec, build_report, environment, write_results
from fuelline.client import ServerDataStream
from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize
from fuelline.server.multimodal.manifest import FORMAT
from fuelline.server.multimodal.source import WindowSource

__all__ = ["run", "ensure_dataset", "sizes"]

SEED = 0
DATASET_FORMAT = 2  # bump when synth or convert change what they write
SPLIT = "train"
HWM = 10
TIMEOUT_S = 60.0
BLOCK_UNITS = 8  # WindowSource's default: recordings whose windows are mixed together
REFERENCE_WINDOWS_PER_S = 980.0
DL_WORKERS = (0, 1, 2)

SERVED, IN_PROCESS = "fuelline serve", "in-process WindowSource"
SERVED_KEPT = "fuelline serve, decoded units kept"
# Two server processes on the host, one client reading from both (``endpoints=[a, b]``: batch k
# from server k mod 2): a server process prepares batches on one core at most (Python's lock), so
# a host that has cores to spare feeds a client faster from two.
SERVED_TWO = "fuelline serve ×2"
# One server of two serving processes (``--processes 2``), its one client reading over a connection
# to each (``connections=2``): the same split of the work as two servers, behind one port.
SERVED_PROCS = "fuelline serve --processes 2, 2 connections"


def sizes(quick: bool) -> dict[str, Any]:
    """Recordings, seconds per recording and batch size, full or tiny."""
    if quick:
        return {"recordings": 10, "seconds": 40.0, "batch_size": 16}
    return {"recordings": 40, "seconds": 60.0, "batch_size": 64}


def epochs_per_round(quick: bool) -> int:
    """Epochs read back to back in one timed pass, so that a pass lasts long enough to time.

    An epoch of the train split is about 1,620 windows: 3 epochs made a pass of 0.15 s, in which
    what every contender does once (its first blocks, a client's session) weighed on the figure,
    and one contender's rounds ranged from 0.57 to 1.03 of in-process."""
    return 1 if quick else 16


def ensure_dataset(data_dir: Path, recordings: int, seconds: float) -> Path:
    """Synthesised raw recordings, converted; both made on first use and reused after (each
    appears by an atomic rename, so a directory that exists is complete)."""
    tag = f"v{DATASET_FORMAT}-{recordings}rec-{int(seconds)}s-seed{SEED}"
    # (the converted data set's name carries the format it is in: a newer one is converted anew)
    raw, dataset = data_dir / f"raw-{tag}", data_dir / f"windows-{tag}-{FORMAT.replace('/', '-')}"
    if not dataset.is_dir():
        data_dir.mkdir(parents=True, exist_ok=True)
        if not raw.is_dir():
            progress(f"synthesising {raw} ...")
            synthesize(str(raw), recordings, seconds, SEED)
        progress(f"converting into {dataset} ...")
        convert(str(raw), str(dataset), progress=False)
    return dataset


def dataloader_name(workers: int) -> str:
    return f"DataLoader, {workers} worker{'s' if workers != 1 else ''}"


# -- the DataLoader contender -----------------------------------------------------------------------
def _torch_data() -> Any:
    import torch.utils.data

    return torch.utils.data


class RecordingBatches:
    """An iterable of ready batches of one split, built from recordings with fuelline's decoder.

    Per epoch (each ``__iter__``): recordings in a seeded order, cut into blocks of
    ``BLOCK_UNITS``; this worker takes blocks ``worker_id, worker_id + workers, ...``, decodes
    each block's recordings, and serves its windows shuffled within the block, as batches of
    ``batch_size`` (rows left over at a block's end start the next block's first batch).
    """

    def __init__(self, dataset: str, batch_size: int, seed: int = SEED) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.source: WindowSource | None = None

    def open(self) -> WindowSource:
        if self.source is None:
            self.source = WindowSource(self.dataset, batch_size=self.batch_size, seed=self.seed)
        return self.source

    def __iter__(self) -> Iterator[tuple[np.ndarray, ...]]:
        src = self.open()
        info = _torch_data().get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        self.epoch += 1  # every worker's copy counts its own epochs, in step with the others
        units = np.random.default_rng([self.seed, self.epoch]).permutation(np.flatnonzero(src.unit_rows(SPLIT)))
        carry: dict[str, np.ndarray] | None = None
        for b in range(worker, -(-len(units) // BLOCK_UNITS), workers):
            parts = [src.windows(SPLIT, int(u)) for u in units[b * BLOCK_UNITS : (b + 1) * BLOCK_UNITS]]
            table = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
            order = np.random.default_rng([self.seed, self.epoch, b]).permutation(len(table["label"]))
            lo = 0
            if carry is not None:
                need = self.batch_size - len(carry["label"])
                carry = {k: np.concatenate([carry[k], table[k].take(order[:need], axis=0)]) for k in table}
                lo = need
                if len(carry["label"]) == self.batch_size:
                    yield self._finish(src, carry)
                    carry = None
            for start in range(lo, len(order), self.batch_size):
                rows = order[start : start + self.batch_size]
                batch = {k: v.take(rows, axis=0) for k, v in table.items()}
                if len(rows) == self.batch_size:
                    yield self._finish(src, batch)
                else:
                    carry = batch
        if carry is not None:
            yield self._finish(src, carry)

    @staticmethod
    def _finish(src: WindowSource, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        out = src.finish_batch(SPLIT, batch, src.sources)
        return tuple(out[s] for s in src.sources)


def _open_in_worker(worker_id: int) -> None:
    _torch_data().get_worker_info().dataset.open()


def make_dataloader(dataset: str, batch_size: int, workers: int) -> Any:
    data = _torch_data()

    class Batches(RecordingBatches, data.IterableDataset):
        pass

    return data.DataLoader(
        Batches(dataset, batch_size), batch_size=None, num_workers=workers, pin_memory=False,
        persistent_workers=workers > 0, worker_init_fn=_open_in_worker if workers else None,
        prefetch_factor=2 if workers else None,
    )


def dataloader_round(loader: Any, epochs: int) -> Round:
    batches = itertools.chain.from_iterable(iter(loader) for _ in range(epochs))
    return time_batches(tuple(t.numpy() for t in batch) for batch in batches)


def close_dataloader(loader: Any) -> None:
    """Stop a DataLoader's persistent workers now rather than whenever it is collected."""
    iterator = getattr(loader, "_iterator", None)
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    gc.collect()


# -- fuelline contenders ------------------------------------------------------------------------------
def in_process_round(source: WindowSource, epoch: list[int], epochs: int) -> Round:
    def batches() -> Iterator[tuple[np.ndarray, ...]]:
        for _ in range(epochs):
            epoch[0] += 1
            for b in source.iter_batches(SPLIT, epoch[0], 0, 1, 0, source.sources):
                yield tuple(b.values())

    # (Not this process's children: the servers and the DataLoaders' workers, idle meanwhile.)
    return time_batches(batches(), threads_of=[os.getpid()], threads_of_children=False)


def served_round(server: ServerProcess | Sequence[ServerProcess], epochs: int, connections: int = 1) -> Round:
    """One client reads ``epochs`` epochs from a server, or from several (each serves its part
    of every batch order: ``ServerDataStream(endpoints=...)``), over ``connections`` to each, all
    their CPU counted (a server's serving processes included)."""
    servers = [server] if isinstance(server, ServerProcess) else list(server)
    with ServerDataStream(None, endpoints=[f"{s.host}:{s.port}" for s in servers], connections=connections, hwm=HWM,
                          timeout=TIMEOUT_S, receive_timeout=TIMEOUT_S) as stream:
        batches = itertools.chain.from_iterable(stream.get_epoch_iterator() for _ in range(epochs))
        return time_batches(batches, producer_pid=[s.pid for s in servers], threads_of=[s.pid for s in servers])


def _checked(r: Round, windows: int, who: str, batch_size: int) -> Round:
    """Every contender delivers the whole split each epoch: a fast one that drops windows is no result."""
    first = windows - r.rows
    if not 0 < first <= batch_size:
        raise RuntimeError(f"{who}: {r.rows} windows after the first batch; the epochs hold {windows}")
    return r


# -- the benchmark ----------------------------------------------------------------------------------
STAGE = "fuelline.server.multimodal.stages:band_power"
SERVED_STAGE = "fuelline serve, a user stage"


def run(rounds: int, data_dir: Path, results_dir: Path = RESULTS_DIR, quick: bool = False,
        before: str | None = None) -> dict[str, Any]:
    from benchmarks import plots

    env = environment()
    size = sizes(quick)
    bs = size["batch_size"]
    epochs = epochs_per_round(quick)
    dataset = str(ensure_dataset(data_dir, size["recordings"], size["seconds"]))
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-") as logs, ExitStack() as stack:
        # Like for like, every contender decodes every epoch (no decoded units kept); SERVED_KEPT is
        # the server as it runs by default, keeping decoded units (the split fits its budget).
        source = WindowSource(dataset, batch_size=bs, seed=SEED, shuffle_block=BLOCK_UNITS, decoded_cache_mb=0)
        stack.callback(source.close)
        windows = source.rows(SPLIT)
        delivered = windows * epochs
        argv = [sys.executable, "-m", "fuelline.server.cli", "serve", dataset, "--port", "0", "--batch-size", str(bs),
                "--hwm", str(HWM), "--seed", str(SEED), "--shuffle-block", str(BLOCK_UNITS), "--status-interval", "0"]
        server = stack.enter_context(ServerProcess(SERVED, [*argv, "--decoded-cache-mb", "0"], Path(logs) / "serve.log"))
        kept = stack.enter_context(ServerProcess(SERVED_KEPT, argv, Path(logs) / "serve-kept.log"))
        second = stack.enter_context(ServerProcess(f"{SERVED_TWO} (second)", [*argv, "--decoded-cache-mb", "0"],
                                                   Path(logs) / "serve-second.log"))
        procs = stack.enter_context(ServerProcess(SERVED_PROCS, [*argv, "--decoded-cache-mb", "0", "--processes", "2"],
                                                  Path(logs) / "serve-processes.log"))
        loaders = {w: make_dataloader(dataset, bs, w) for w in DL_WORKERS}
        for loader in loaders.values():
            stack.callback(close_dataloader, loader)
        epoch = [0]
        compared: list[Contender] = []
        ratios_before: list[RatioSpec] = []
        if before is not None:
            tree = stack.enter_context(SourceTree(before, Path(logs)))
            old = {}
            for name, extra in ((SERVED, []), (SERVED_STAGE, ["--stage", STAGE])):
                now_server = stack.enter_context(ServerProcess(name, [*argv, "--decoded-cache-mb", "0", *extra],
                                                               Path(logs) / f"serve-now-{len(old)}.log"))
                if extra:
                    compared.append(Contender(name, lambda s=now_server, n=name: _checked(served_round(s, epochs), delivered, n, bs)))
                label = f"{name} ({before})"
                old[name] = stack.enter_context(ServerProcess(label, [*argv, "--decoded-cache-mb", "0", *extra],
                                                              Path(logs) / f"serve-before-{len(old)}.log",
                                                              pythonpath=tree.pythonpath))
                compared.append(Contender(label, lambda s=old[name], n=label: _checked(served_round(s, epochs), delivered, n, bs)))
                ratios_before.append(RatioSpec(name, label))
        contenders = [
            Contender(SERVED, lambda: _checked(served_round(server, epochs), delivered, SERVED, bs)),
            Contender(SERVED_KEPT, lambda: _checked(served_round(kept, epochs), delivered, SERVED_KEPT, bs)),
            Contender(SERVED_TWO, lambda: _checked(served_round([server, second], epochs), delivered, SERVED_TWO, bs)),
            Contender(SERVED_PROCS, lambda: _checked(served_round(procs, epochs, connections=2), delivered,
                                                     SERVED_PROCS, bs)),
            Contender(IN_PROCESS, lambda: _checked(in_process_round(source, epoch, epochs), delivered, IN_PROCESS, bs)),
            *(Contender(dataloader_name(w), lambda w=w: _checked(dataloader_round(loaders[w], epochs), delivered,
                                                               dataloader_name(w), bs)) for w in DL_WORKERS),
            *compared,
        ]
        wps = Metric("windows/s", lambda r: r.rows / r.seconds, "{:,.0f}")
        mbs = Metric("MB/s", lambda r: r.bytes / r.seconds / 1e6, "{:,.0f}")
        results = alternate(contenders, rounds, lambda r: f"{wps.of(r):,.0f} windows/s")
        stack.close()
        exits = {SERVED: server.exit_status, SERVED_KEPT: kept.exit_status, f"{SERVED_TWO} (second)": second.exit_status,
                 SERVED_PROCS: procs.exit_status}
    medians = {name: statistics.median(wps.of(r) for r in rs) for name, rs in results.items()}
    best_dl = max((dataloader_name(w) for w in DL_WORKERS), key=medians.__getitem__)
    served_over_ref = medians[SERVED] / REFERENCE_WINDOWS_PER_S
    kept_over_ref = medians[SERVED_KEPT] / REFERENCE_WINDOWS_PER_S
    parameters = {
        "rounds": rounds, "quick": quick, **size, "seed": SEED, "train_windows": windows, "epochs_per_round": epochs,
        "shuffle_block": BLOCK_UNITS,
        "window": "2.0 s every 1.0 s, max gap 2, zscore", "hwm": HWM, "dataloader_workers": list(DL_WORKERS),
        "dataset": dataset, "before": before,
    }
    notes = [
        f"{rounds} timed rounds after one untimed warm-up pass of each, contenders alternately; {epochs} epoch(s) of "
        f"the train split ({windows} windows of {size['recordings']} synth recordings × {size['seconds']:.0f} s) back "
        f"to back per round, all seven sources, batches of {bs}, shuffled in blocks of 8 recordings.",
        "A rate counts the windows after the first batch over the time from its arrival to the last batch's "
        "(epoch boundaries included, as a trainer sees them).",
        "fuelline serve: one server process (read-ahead threads, --workers 0, --decoded-cache-mb 0: every epoch "
        "decoded again, as in-process and DataLoader do) for all rounds, a new client per round; in-process: one "
        "WindowSource (decoded_cache_mb=0) for all rounds, the next epoch each round.",
        f"{SERVED_KEPT}: a second server with the default --decoded-cache-mb 1024, which holds the decoded split "
        "after its warm-up pass, so its rounds gather, encode and send but decode nothing: what a long-running "
        "server gives from its second epoch on when the decoded data set fits its memory. Not like for like; "
        "the targets are judged on fuelline serve.",
        f"{SERVED_TWO}: the fuelline serve process above and a second one like it (every epoch decoded) on this "
        "host, read by one ServerDataStream(endpoints=[both]): batch k comes from server k mod 2, each serving its "
        "part of the epoch (so each decodes every recording). One server prepares a client's batches on one "
        "thread of one process, which Python's interpreter lock keeps near one core whatever the host has; "
        "this is what a host with cores to spare gets by running two (`--servers host:a,host:b` for a trainer). "
        "Server CPU is both processes'.",
        f"{SERVED_PROCS}: one `fuelline serve --processes 2` (every epoch decoded), read by one "
        "ServerDataStream(connections=2): the client on the server's host is dealt one session to each serving "
        "process, each serving its part of the epoch, as two servers would, behind one port. Server CPU is the "
        "supervisor's and both serving processes'.",
        "DataLoader: IterableDataset over recordings calling WindowSource.windows and finish_batch (the same "
        "alignment, normalisation and cast), batch_size=None, the source built in each worker by worker_init_fn, "
        "persistent workers, pin_memory off, prefetch_factor 2; batches arrive as tensors (zero-copy to numpy).",
        f"best DataLoader: {best_dl}. fuelline serve delivers {served_over_ref:.1f}× the "
        f"{REFERENCE_WINDOWS_PER_S:.0f} windows/s of the Arrow pipeline this work started from (target ≥ 20×); "
        f"with decoded units kept, {kept_over_ref:.1f}×.",
        "Server and consumer share this machine's cores; in-process and DataLoader have no server to share with.",
    ]
    record, md = build_report(
        "pipeline", f"pipeline — aligned AMIGOS windows delivered to a consumer ({size['recordings']} recordings)",
        results, [wps, mbs], [RatioSpec(SERVED, IN_PROCESS, 1.0), RatioSpec(SERVED, best_dl, 1.5),
                              RatioSpec(SERVED_TWO, IN_PROCESS, 1.0), RatioSpec(SERVED_TWO, best_dl, 1.5),
                              RatioSpec(SERVED_PROCS, IN_PROCESS, 1.0), RatioSpec(SERVED_PROCS, best_dl, 1.5),
                              RatioSpec(SERVED_TWO, SERVED), RatioSpec(SERVED_PROCS, SERVED),
                              RatioSpec(SERVED_KEPT, IN_PROCESS), *ratios_before],
        parameters, notes, env, exits=exits,
        extra={"reference_windows_per_s": REFERENCE_WINDOWS_PER_S, "best_dataloader": best_dl,
               "served_over_reference": {"value": served_over_ref, "target": 20.0,
                                         "meets_target": served_over_ref >= 20.0},
               "kept_over_reference": kept_over_ref},
    )
    print(md, flush=True)
    for path in write_results("pipeline", record, md, results_dir):
        print(f"wrote {path}", flush=True)
    print(f"wrote {plots.pipeline(record, results_dir)}", flush=True)
    return record
