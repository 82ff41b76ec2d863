"""fuelline beside what a user would pick instead, on the same data, batch size and host: each
system reads 2 epochs a round with its own shuffle, in alternating rounds, and every figure is
compared within the run (medians, and the ratio to fuelline round by round). Two workloads:

- table: a flat table (``dataset``), every system reading the same Parquet files or its own copy
  of them (``peers.json``, ``.md``, ``.png``);
- windows: time-aligned multimodal windows (``windows_data``). fuelline serves the converted
  recordings and aligns windows as it serves them; the peers, which cannot align, read every window
  of the train split materialised once (untimed) through fuelline's own pipeline, as a Parquet
  table and each in its own format (``peers-windows.json``, ``.md``, ``.png``).

Per contender and round: rows/s and MB/s (the rows after the first batch, over the span from its
arrival to the last batch's), CPU seconds per 1,000 rows of every process involved (the reader and
all it started: servers, DataLoader workers, dispatchers, raylets) over the same span, their peak
memory (the sum of each process's peak resident set), seconds to the first batch from the reader's
start and from the start of everything (its server or cluster included), and how widely a batch
is mixed: the mean number of distinct row groups (row id // rows per group) in a full batch, or for
the windows, of distinct recordings (sample id // 1,000,000).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from benchmarks.common import RESULTS_DIR, Round, progress
from benchmarks.peers import dataset, venvs
from benchmarks.peers.contenders import (
    FUELLINE,
    PEERS,
    WINDOWS_PEERS,
    Peer,
    ReaderFailed,
    netns_available,
    run_reader,
)
from benchmarks.report import Metric, RatioSpec, build_report, environment, write_results

__all__ = ["run", "PeerRound", "METRICS", "WORKLOADS", "metrics"]

BATCH_SIZE = 1024
WINDOWS_BATCH_SIZE = 64  # as the pipeline benchmark and `fuelline serve` default
EPOCHS = 2
SHUFFLE_GROUPS = 8  # a shuffle buffer of this many row groups' rows (recordings' windows), as fuelline's --shuffle-block default
READER_TIMEOUT_S, QUICK_READER_TIMEOUT_S = 900.0, 180.0
PREPARE_TIMEOUT_S = 3600.0
WORKLOADS = ("table", "windows")


@dataclass(frozen=True, kw_only=True)
class PeerRound(Round):
    """A Round (``consumer_cpu_s``: every process of the reader's tree over the timed span) and
    what the peers benchmark takes beside it."""

    cpu_reader_s: float  # the same tree from the reader's start to the last batch
    peak_rss_bytes: int
    first_batch_s: float
    first_batch_from_start_s: float
    mix: float
    epoch_rows: list[int] = field(default_factory=list)
    epoch_distinct_rows: list[int] = field(default_factory=list)
    processes: dict[str, int] = field(default_factory=dict)
    server_exit: dict[str, Any] | None = None  # how fuelline's server ended when told to stop


def _metric(unit: str, fn: Any, fmt: str) -> Metric:
    return Metric(unit, fn, fmt)


def metrics(noun: str = "rows", group: str = "row groups") -> list[Metric]:
    """The figures of a round, in ``noun`` (rows, windows) and ``group`` (row groups, recordings):
    the rate first (the one ratios compare), then MB/s, CPU over the timed span and over the whole
    pass, peak memory, time to the first batch (two ways) and the batch mix."""
    return [
        _metric(f"{noun}/s", lambda r: r.rows / r.seconds, "{:,.0f}"),
        _metric("MB/s", lambda r: r.bytes / r.seconds / 1e6, "{:,.0f}"),
        # (producer_cpu_s: the server's on another host, in the bed; None here, where the server is in the tree)
        _metric(f"CPU s/1k {noun}", lambda r: 1e3 * (r.consumer_cpu_s + (r.producer_cpu_s or 0.0)) / r.rows, "{:.4f}"),
        _metric(f"CPU s/1k {noun}, whole pass", lambda r: 1e3 * r.cpu_reader_s / max(1, sum(r.epoch_rows)), "{:.4f}"),
        _metric("peak MB", lambda r: r.peak_rss_bytes / 1e6, "{:,.0f}"),
        _metric("s to first batch", lambda r: r.first_batch_s, "{:.2f}"),
        _metric("s to first batch, from start", lambda r: r.first_batch_from_start_s, "{:.2f}"),
        _metric(f"{group}/batch", lambda r: r.mix, "{:.1f}"),
    ]


METRICS = metrics()
ROWS_S, CPU_1K = METRICS[0], METRICS[2]


def _round(result: dict[str, Any]) -> PeerRound:
    from_start = result.get("first_batch_from_server_s")
    return PeerRound(
        result["batches"], result["rows"], result["bytes"], result["seconds"], result["cpu_s"], None,
        cpu_reader_s=result["cpu_reader_s"], peak_rss_bytes=result["peak_rss_bytes"],
        first_batch_s=result["first_batch_s"],
        first_batch_from_start_s=result["first_batch_s"] if from_start is None else from_start,
        mix=result["mix"], epoch_rows=result["epoch_rows"], epoch_distinct_rows=result["epoch_distinct_rows"],
        processes=result.get("processes", {}), server_exit=result.get("server_exit"),
    )


def _select(keys: Sequence[str] | None, peers: Sequence[Peer]) -> list[Peer]:
    if not keys:
        return list(peers)
    known = {p.key: p for p in (*PEERS, *WINDOWS_PEERS)}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(f"unknown peers {unknown}; known: {', '.join(known)}")
    if "fuelline" not in keys:
        keys = ["fuelline", *keys]
    return [p for p in peers if p.key in keys]


@dataclass(frozen=True)
class Workload:
    """What one workload's run reads, and the words its report uses."""

    key: str  # "table" or "windows"
    name: str  # of its results files
    root: Path  # the data folder every reader gets (--data)
    rows: int  # an epoch's rows (windows)
    groups: int  # row groups (recordings) they are in
    batch_size: int
    options: dict[str, Any]  # every reader's options
    peers: list[Peer]
    warm: tuple[Path, ...]  # folders read once before the rounds
    random_mix: float  # groups in a batch drawn uniformly
    metrics: list[Metric]
    data: dict[str, Any]  # how the data was made or found


def _table_workload(data_dir: Path, quick: bool, keys: Sequence[str] | None) -> Workload:
    table = dataset.QUICK if quick else dataset.FULL
    root, generation = dataset.ensure(data_dir, table)
    options = {"data": root, "epochs": EPOCHS, "batch_size": BATCH_SIZE, "rows_per_group": table.rows_per_group,
               "rows": table.rows, "shuffle_rows": SHUFFLE_GROUPS * table.rows_per_group}
    g = table.groups
    return Workload("table", "peers", root, table.rows, g, BATCH_SIZE, options, _select(keys, PEERS), (root,),
                    g * (1 - (1 - 1 / g) ** BATCH_SIZE), METRICS, {**generation, "table": table})


def _windows_workload(data_dir: Path, quick: bool, keys: Sequence[str] | None) -> Workload:
    from benchmarks.peers import windows_data

    size = windows_data.QUICK if quick else windows_data.FULL
    converted, root, meta = windows_data.ensure(data_dir, size)
    counts = meta["windows_per_recording"]
    windows = int(meta["windows"])
    shuffle_rows = round(SHUFFLE_GROUPS * windows / len(counts))
    options = {"data": root, "dataset": converted, "epochs": EPOCHS, "batch_size": WINDOWS_BATCH_SIZE,
               "rows_per_group": windows_data.SAMPLE_ID_STRIDE, "rows": windows, "shuffle_rows": shuffle_rows}
    peers = [dataclasses.replace(p, name=f"fuelline serve --shuffle-block {len(counts)}",
                                 extra=(*p.extra, "--shuffle-block", str(len(counts)))) if p.block_all else p
             for p in _select(keys, WINDOWS_PEERS)]
    # The expected number of recordings a batch of windows drawn uniformly (without replacement) touches.
    mix = sum(1 - _none_drawn(windows, n, WINDOWS_BATCH_SIZE) for n in counts)
    return Workload("windows", "peers-windows", root, windows, len(counts), WINDOWS_BATCH_SIZE, options, peers,
                    (root, converted), mix, metrics("windows", "recordings"),
                    {**meta, "converted": str(converted), "size": size, "shuffle_rows": shuffle_rows})


def _none_drawn(total: int, n: int, k: int) -> float:
    """The chance that k rows drawn without replacement out of ``total`` miss a group of n."""
    p = 1.0
    for i in range(k):
        p *= max(0.0, (total - n - i) / (total - i))
    return p


def _environments(peers: list[Peer], quick: bool, logs: Path, not_run: dict[str, str]) -> None:
    """Build the peers' environments (not in quick mode, which takes those already built)."""
    checked: dict[str, str | None] = {}
    netns_problem = netns_available() if any(p.netns for p in peers) else None
    for peer in peers:
        if peer.netns and netns_problem:
            not_run[peer.name] = netns_problem
            continue
        if peer.env is None:
            continue
        if peer.env not in checked:
            env = venvs.ENVS[peer.env]
            if venvs.ready(env):
                checked[peer.env] = None
            elif quick:
                checked[peer.env] = f"its environment {env.path} is not built (quick mode builds none)"
            else:
                progress(f"building the {peer.env} environment ({', '.join(env.requirements)}) ...")
                try:
                    venvs.ensure(env, logs / f"venv-{peer.env}.log")
                    checked[peer.env] = None
                except RuntimeError as exc:
                    checked[peer.env] = f"cannot be installed here: {exc}"
        if checked[peer.env]:
            not_run[peer.name] = checked[peer.env] or ""


def _prepare(peers: list[Peer], options: dict[str, Any], logs: Path, not_run: dict[str, str]) -> dict[str, float]:
    """Each peer's one-time copy of the data in its own format; seconds it took (0: reused)."""
    done: dict[str, float] = {}
    for peer in peers:
        if not peer.prepare or peer.name in not_run:
            continue
        if peer.script in done:
            continue
        progress(f"preparing {peer.script} data ...")
        try:
            result = run_reader(peer, options, logs / f"prepare-{peer.key}.log", PREPARE_TIMEOUT_S, prepare=True)
            done[peer.script] = 0.0 if result.get("reused") else float(result.get("prepared_s", 0.0))
        except ReaderFailed as exc:
            for p in peers:
                if p.script == peer.script:
                    not_run[p.name] = f"its conversion failed: {exc}"
    return done


def _alternate(w: Workload, rounds: int, logs: Path, timeout: float, not_run: dict[str, str]) -> dict[str, list[Round]]:
    """One untimed warm-up pass of each, then ``rounds`` rounds of one pass each, in turn. A peer
    that fails is recorded as not run, with why, and leaves the run."""
    active = [p for p in w.peers if p.name not in not_run]
    results: dict[str, list[Round]] = {}
    rate, cpu, mix = w.metrics[0], w.metrics[2], w.metrics[-1]

    def one(peer: Peer, label: str, seed: int) -> PeerRound | None:
        started = time.perf_counter()
        try:
            r = _round(run_reader(peer, {**w.options, "seed": seed}, logs / f"{peer.key}.log", timeout))
        except ReaderFailed as exc:
            not_run[peer.name] = f"failed in {label}: {exc}"
            progress(f"{label} {peer.name}: FAILED: {exc}")
            return None
        progress(f"{label} {peer.name}: {rate.of(r):,.0f} {rate.unit}, {cpu.of(r):.4f} {cpu.unit}, "
                 f"first batch {r.first_batch_s:.2f}s ({r.first_batch_from_start_s:.2f}s from start), "
                 f"{mix.of(r):.1f} {mix.unit} ({time.perf_counter() - started:.0f}s)")
        return r

    for peer in active:
        one(peer, f"{w.key} warm-up", 0)
    for i in range(rounds):
        for peer in active:
            if peer.name in not_run:
                continue
            r = one(peer, f"{w.key} round {i + 1}/{rounds}", i + 1)
            if r is not None:
                results.setdefault(peer.name, []).append(r)
    return {name: rs for name, rs in results.items() if name not in not_run}


def run(rounds: int, data_dir: Path, results_dir: Path = RESULTS_DIR, quick: bool = False,
        peers: Sequence[str] | None = None, workloads: Sequence[str] = WORKLOADS) -> dict[str, dict[str, Any]]:
    """Run the peers benchmark on each of ``workloads`` in turn ("table", "windows"), print each
    one's table and write its results (peers.json and .md; peers-windows.json and .md); returns
    the records by workload."""
    unknown = [k for k in workloads if k not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    records = {}
    for key in (k for k in WORKLOADS if k in workloads):
        env = environment()
        w = _table_workload(data_dir, quick, peers) if key == "table" else _windows_workload(data_dir, quick, peers)
        records[key] = _run_workload(w, rounds, results_dir, quick, env)
    return records


def _run_workload(w: Workload, rounds: int, results_dir: Path, quick: bool, env: dict[str, Any]) -> dict[str, Any]:
    not_run: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-peers-") as tmp:
        logs = w.root / "logs" if not quick else Path(tmp)
        _environments(w.peers, quick, logs, not_run)
        prepared = _prepare(w.peers, w.options, logs, not_run)
        cached = sum(_warm_page_cache(folder) for folder in w.warm)
        results = _alternate(w, rounds, logs, QUICK_READER_TIMEOUT_S if quick else READER_TIMEOUT_S, not_run)
    if FUELLINE not in results:
        raise RuntimeError(f"fuelline did not run ({w.key}): {not_run.get(FUELLINE)}")
    ran = [p for p in w.peers if p.name in results]
    record, md = _report(w, results, ran, not_run, rounds, quick, prepared, cached, env)
    print(md, flush=True)
    for path in write_results(w.name, record, md, results_dir):
        print(f"wrote {path}", flush=True)
    return record


def _warm_page_cache(root: Path) -> int:
    """Read every file of the data and of the peers' copies once, so that none is first to pay
    for the disk."""
    total = 0
    for path in sorted(root.rglob("*")):
        if path.is_file() and "logs" not in path.parts:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    total += len(chunk)
    return total


# -- the report ----------------------------------------------------------------------------------------
COPIES = {"read_mosaic.py": ("mosaic", "MDS", "mds"), "read_litdata.py": ("litdata", "LitData chunks", "litdata"),
          "read_tfdata.py": ("tfdata", "fixed-length records", "records")}


def _report(w: Workload, results: dict[str, list[Round]], ran: list[Peer], not_run: dict[str, str], rounds: int,
            quick: bool, prepared: dict[str, float], cached: int, env: dict[str, Any]) -> tuple[dict[str, Any], str]:
    rate, cpu, whole = w.metrics[0], w.metrics[2], w.metrics[3]
    others = [p.name for p in ran if p.name != FUELLINE]
    ratios = [RatioSpec(FUELLINE, o, 1.0) for o in others]
    ratios += [RatioSpec(FUELLINE, o, None, metric=cpu.unit, higher=False) for o in others]
    ratios += [RatioSpec(FUELLINE, o, None, metric=whole.unit, higher=False) for o in others]
    complete = {name: all(d == w.rows for d in r.epoch_distinct_rows)  # type: ignore[attr-defined]
                for name, rs in results.items() for r in rs[:1]}
    incomplete = [name for name, rs in results.items()
                  if any(d != w.rows for r in rs for d in r.epoch_distinct_rows)]  # type: ignore[attr-defined]
    order = "one untimed warm-up pass of each, then rounds of " + ", ".join(results)
    sizes = {script: _copy_bytes(w.root, script) for script in prepared}
    if w.key == "table":
        table = w.data["table"]
        parameters: dict[str, Any] = {
            "rounds": rounds, "quick": quick, "rows": table.rows, "rows_per_group": table.rows_per_group,
            "row_groups": table.groups, "files": table.files, "row_bytes": dataset.ROW_BYTES, "batch_size": BATCH_SIZE,
            "epochs_per_round": EPOCHS, "shuffle_buffer_rows": SHUFFLE_GROUPS * table.rows_per_group,
            "peers": [p.key for p in w.peers], "order": order,
        }
        notes = _table_notes(w, table, cached, prepared)
        title = f"peers — {EPOCHS} epochs of a {table.rows:,}-row table, batches of {BATCH_SIZE}, "
        data: dict[str, Any] = {"generation": {k: v for k, v in w.data.items() if k != "table"}}
    else:
        size = w.data["size"]
        parameters = {
            "rounds": rounds, "quick": quick, "recordings_synthesised": size.recordings, "seconds": size.seconds,
            "windows": w.rows, "recordings": w.groups, "window_bytes": w.data["window_bytes"], "files": size.files,
            "batch_size": w.batch_size, "epochs_per_round": EPOCHS, "shuffle_buffer_windows": w.options["shuffle_rows"],
            "window": "2.0 s every 1.0 s, max gap 2, zscore", "sources": w.data["sources"],
            "peers": [p.key for p in w.peers], "order": order,
        }
        notes = _windows_notes(w, cached, prepared, sizes)
        title = (f"peers, windows — {EPOCHS} epochs of {w.rows:,} aligned windows of {w.groups} recordings, "
                 f"batches of {w.batch_size}, ")
        data = {"materialisation": {k: v for k, v in w.data.items() if k not in ("size", "windows_per_recording")},
                "copy_bytes": sizes}
    if incomplete:
        notes.append(f"NOT every {rate.unit.split('/')[0][:-1]} once per epoch: " + ", ".join(incomplete) + ".")
    for name, why in not_run.items():
        notes.append(f"{name}: not run: {why}")
    versions = {name: venvs.versions(e) for name, e in venvs.ENVS.items() if any(p.env == name for p in ran)}
    record, md = build_report(
        w.name, title + ("quick" if quick else "full") + " size", results, w.metrics, ratios, parameters, notes, env,
        exits=_exits(results),
        extra={"workload": w.key, "not_run": {n: f"not run: {why}" for n, why in not_run.items()}, **data,
               "prepared_s": prepared, "peer_versions": versions, "every_row_once": complete,
               "processes": {name: rs[-1].processes for name, rs in results.items()}},  # type: ignore[attr-defined]
    )
    return record, md + _summary(record, not_run, w.metrics)


def _copy_bytes(root: Path, script: str) -> int:
    from benchmarks.peers.windows_data import folder_bytes

    return folder_bytes(root / COPIES[script][2]) if script in COPIES else 0


COMMON_NOTES = (
    "CPU s/1k {noun}: the CPU time of every process of the reader's tree (the reader and all it started: the "
    "fuelline server, DataLoader workers, Ray's GCS, raylet and workers, tf.data's dispatcher and worker), "
    "from /proc (each live process's own time and that of its children that ended), over the same span; "
    "'whole pass': from making the reader to its last batch, over every {row} delivered, so that work done before "
    "the first batch (a server decoding ahead, a pipeline filling its buffers) counts too (the server's or "
    "cluster's own start-up does not). The 'CPU s/GB' column is the timed span's per GB.",
    "peak MB: the sum of every process's peak resident set (VmHWM); pages shared between processes (fuelline's "
    "shared memory, forked DataLoader workers, memory-mapped files, Ray's object store) count in each.",
    "s to first batch: from making the reader (stream, dataset and loader) to its first batch; 'from start': from "
    "starting its server or cluster (fuelline serve, ray.init, the tf.data servers), the same for those "
    "without one.",
)
NETNS_NOTE = ("Ray and tf.data service run in a network namespace of their own with only a loopback interface: both "
              "bind their servers on every interface (Ray even with _node_ip_address='127.0.0.1').")


def _table_notes(w: Workload, table: dataset.Table, cached: int, prepared: dict[str, float]) -> list[str]:
    generation = w.data
    notes = [
        f"Table: {table.rows:,} rows × (64 float32 features as one fixed-size list, int64 label, int64 row id), "
        f"{table.groups} row groups of {table.rows_per_group:,} rows in {table.files} Parquet files, "
        f"{table.rows * dataset.ROW_BYTES / 1e6:.0f} MB of numbers; "
        + ("reused from an earlier run." if generation.get("reused") else f"generated by this run ({generation.get('generation_s')}s)."),
        f"Each round is one new reader process per contender reading {EPOCHS} epochs of batches of {BATCH_SIZE} "
        "(every system's own shuffle, seeded by the round where it takes a seed); contenders alternately, after one "
        f"untimed warm-up pass of each; page cache warm for all ({cached / 1e6:.0f} MB read once before).",
        "rows/s, MB/s: the rows after the first batch, over the span from its arrival to the last batch's. MB = 10^6 "
        "bytes of the three arrays as delivered.",
        *(n.format(noun="rows", row="row") for n in COMMON_NOTES),
        f"row groups/batch: the mean number of distinct row groups in a full batch (a sequential read: 1, or 2 "
        f"where a batch straddles a boundary; fully random: about {w.random_mix:.1f}).",
        "fuelline: `fuelline serve` of the Parquet folder with its defaults (shuffled, --shuffle-block 8, decoded "
        "row groups kept, --hwm 10 here) started by the reader, then ServerDataStream(tensors=True) on the same "
        "host (it moves to the server's Unix socket and shared memory). 'fuelline serve --shuffle-block 80': the same "
        "with all 80 row groups in one shuffle block, so that its batches are as mixed as a uniform shuffle's. Every "
        "reader imports its framework (torch, ray, tensorflow) before its timing starts.",
        f"DataLoader over pyarrow: an IterableDataset reading row groups in a shuffled order into a shuffle buffer of "
        f"{SHUFFLE_GROUPS} row groups' rows, yielding whole batches (benchmarks/peers/read_pyarrow.py).",
        "Mosaic Streaming: MDSWriter once, StreamingDataset(shuffle=True) + DataLoader; LitData: optimize once, "
        "StreamingDataset(shuffle=True) + StreamingDataLoader; both collate per-sample dicts. "
        f"Ray Data: read_parquet(shuffle='files') + iter_torch_batches(local_shuffle_buffer_size={SHUFFLE_GROUPS} "
        "row groups' rows), ray.init(_node_ip_address='127.0.0.1', include_dashboard=False, num_cpus=2) per round. "
        "tf.data service: dispatcher and worker processes, fixed-length records, shuffle buffer of the same size.",
        NETNS_NOTE,
    ]
    if prepared:
        notes.append("One-time conversions (not timed in rounds): " + ", ".join(
            f"{script.removeprefix('read_').removesuffix('.py')} " + (f"{s:.1f}s" if s else "reused")
            for script, s in prepared.items()) + ".")
    return notes


def _windows_notes(w: Workload, cached: int, prepared: dict[str, float], sizes: dict[str, int]) -> list[str]:
    from benchmarks.peers import readerlib

    m, size = w.data, w.data["size"]
    cols = readerlib.columns(w.root)
    shapes = ", ".join(f"{c.name} {np.dtype(c.dtype).name}"
                       + (f" [{', '.join(map(str, c.shape))}]" if c.shape else "") for c in cols)
    epoch_mb = w.rows * m["window_bytes"] / 1e6
    copies = [f"{COPIES[script][0]} ({COPIES[script][1]}) " + (f"{s:.1f}s" if s else "reused from an earlier run")
              + f", {sizes.get(script, 0) / 1e6:,.0f} MB" for script, s in prepared.items() if script in COPIES]
    notes = [
        f"Windows: the {w.rows:,} windows of the train split ({w.groups} recordings) of {size.recordings} recordings "
        f"of {size.seconds:.0f} s made by `fuelline synth` (AMIGOS-like: clocks off, drifting, jittering, dropping "
        f"samples) and converted once by `fuelline convert` ({Path(m['converted']).name}); 2.0 s windows every 1.0 s, "
        f"z-scored, every source: {shapes}; {m['window_bytes']:,} bytes a window, {epoch_mb:,.0f} MB an epoch.",
        "The peers cannot align: they read the windows materialised once, not timed: every window of the train split "
        "read through fuelline's own pipeline in-process (WindowSource.windows and finish_batch: aligned, cut, "
        "z-scored and cast as the server serves them), written as a Parquet table of fixed-size-list columns, a row "
        f"group per recording in {size.files} files (benchmarks/peers/windows_data.py): "
        + (f"{m['materialise_s']:.1f}s" if not m.get("reused") else f"{m['materialise_s']:.1f}s in an earlier run, reused")
        + f", {m['parquet_bytes'] / 1e6:,.0f} MB"
        + ("; then each peer's own copy from that table: " + "; ".join(copies) if copies else "") + ".",
        f"Each round is one new reader process per contender reading {EPOCHS} epochs of batches of {w.batch_size} "
        "windows (every system's own shuffle, seeded by the round where it takes a seed); contenders alternately, "
        f"after one untimed warm-up pass of each; page cache warm for all ({cached / 1e6:,.0f} MB read once before: "
        "the converted dataset and every copy).",
        "windows/s, MB/s: the windows after the first batch, over the span from its arrival to the last batch's. "
        f"MB = 10^6 bytes of the {len(cols)} arrays as delivered.",
        *(n.format(noun="windows", row="window") for n in COMMON_NOTES),
        "recordings/batch: the mean number of distinct recordings (sample id // 1,000,000) in a full batch (fuelline's "
        f"default shuffle mixes blocks of 8 recordings: at most 8; fully random: about {w.random_mix:.1f}).",
        f"fuelline: `fuelline serve` of the converted dataset with its defaults (--window 2.0 --hop 1.0 --normalize "
        f"zscore, shuffled in blocks of 8 recordings, --batch-size {w.batch_size}, --hwm 10 here, decoded recordings "
        "kept: the first epoch of a round aligns every window, the second takes the aligned recordings kept) started "
        "by the reader, then ServerDataStream(tensors=True) on the same host (Unix socket and shared memory). "
        "'--decoded-cache-mb 0': the same, aligning every window of every epoch. '--shuffle-block N': every "
        "recording in one shuffle block, so that its batches are as mixed as a uniform shuffle's. Every reader "
        "imports its framework (torch, ray, tensorflow) before its timing starts.",
        f"DataLoader over pyarrow: an IterableDataset reading row groups (recordings) in a shuffled order into a "
        f"shuffle buffer of {SHUFFLE_GROUPS} recordings' windows ({w.options['shuffle_rows']:,}), yielding whole "
        "batches (benchmarks/peers/read_pyarrow.py).",
        "Mosaic Streaming: MDSWriter once (every source an ndarray of fixed dtype and shape, or a scalar), "
        "StreamingDataset(shuffle=True) + DataLoader; LitData: optimize once, StreamingDataset(shuffle=True) + "
        "StreamingDataLoader; both collate per-sample dicts. Ray Data: read_parquet(shuffle='files') + "
        f"iter_torch_batches(local_shuffle_buffer_size={w.options['shuffle_rows']:,}), each fixed-size list reshaped "
        "to its source's shape, ray.init(_node_ip_address='127.0.0.1', include_dashboard=False, num_cpus=2) per round. "
        "tf.data service: dispatcher and worker processes, a fixed-length record a window and a file a recording, "
        "shuffle buffer of the same size.",
        NETNS_NOTE,
    ]
    return notes


def _exits(results: dict[str, list[Round]]) -> dict[str, dict[str, Any]]:
    """How fuelline's server (one per round) ended on SIGTERM: the first that was not clean, else the last."""
    exits = [r.server_exit for r in results.get(FUELLINE, []) if r.server_exit]  # type: ignore[attr-defined]
    if not exits:
        return {}
    return {"fuelline serve (one a round)": next((e for e in exits if not e.get("clean")), exits[-1])}


def _summary(record: dict[str, Any], not_run: dict[str, str], units: Sequence[Metric] = METRICS) -> str:
    rate, cpu_unit, whole, mix = units[0].unit, units[2].unit, units[3].unit, units[-1].unit
    lines = ["", "### Beside fuelline, round by round", "",
             f"| contender | {rate}, median | fuelline / it, per round (min–max) | {cpu_unit} | it / fuelline, "
             f"per round | {whole} | it / fuelline, per round | {mix} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def inverse(label: str) -> str:
        q = record["ratios"][label]

        def flip(key: str) -> str:  # (no ratio where a CPU time measured none)
            return f"{1 / q[key]:.2f}" if q[key] and math.isfinite(q[key]) else "—"

        return f"{flip('of_medians')} ({flip('max_per_round')}–{flip('min_per_round')})"

    for name, entry in record["contenders"].items():
        if name == FUELLINE:
            speed = cpu = cpu_whole = "1"
        else:
            r = record["ratios"][f"{FUELLINE} / {name}"]
            speed = f"{r['of_medians']:.2f} ({r['min_per_round']:.2f}–{r['max_per_round']:.2f})"
            cpu = inverse(f"{FUELLINE} / {name} ({cpu_unit})")
            cpu_whole = inverse(f"{FUELLINE} / {name} ({whole})")
        lines.append(f"| {name} | {entry[rate]['median']:,.0f} | {speed} | {entry[cpu_unit]['median']:.4f} | "
                     f"{cpu} | {entry[whole]['median']:.4f} | {cpu_whole} | {entry[mix]['median']:.1f} |")
    for name, why in not_run.items():
        lines.append(f"| {name} | not run: {why[:160]} | | | | | | |")
    return "\n".join(lines) + "\n"
