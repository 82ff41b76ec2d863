"""fuelline beside what a user would pick instead, on the same flat table, batch size and host:
each system reads 2 epochs a round with its own shuffle, in alternating rounds, and every figure
is compared within the run (medians, and the ratio to fuelline round by round).

Per contender and round: rows/s and MB/s (the rows after the first batch, over the span from its
arrival to the last batch's), CPU seconds per 1,000 rows of every process involved (the reader and
all it started: servers, DataLoader workers, dispatchers, raylets) over the same span, their peak
memory (the sum of each process's peak resident set), seconds to the first batch from the reader's
start and from the start of everything (its server or cluster included), and how widely a batch
is mixed: the mean number of distinct row groups (row id // rows per group) in a full batch.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from benchmarks.common import RESULTS_DIR, Round, progress
from benchmarks.peers import dataset, venvs
from benchmarks.peers.contenders import FUELLINE, PEERS, Peer, ReaderFailed, netns_available, run_reader
from benchmarks.report import Metric, RatioSpec, build_report, environment, write_results

__all__ = ["run", "PeerRound", "METRICS"]

BATCH_SIZE = 1024
EPOCHS = 2
SHUFFLE_GROUPS = 8  # a shuffle buffer of this many row groups' rows, as fuelline's --shuffle-block default
READER_TIMEOUT_S, QUICK_READER_TIMEOUT_S = 900.0, 180.0
PREPARE_TIMEOUT_S = 3600.0


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


ROWS_S = _metric("rows/s", lambda r: r.rows / r.seconds, "{:,.0f}")
# (producer_cpu_s: the server's on another host, in the bed; None here, where the server is in the tree)
CPU_1K = _metric("CPU s/1k rows", lambda r: 1e3 * (r.consumer_cpu_s + (r.producer_cpu_s or 0.0)) / r.rows, "{:.4f}")
METRICS = [
    ROWS_S,
    _metric("MB/s", lambda r: r.bytes / r.seconds / 1e6, "{:,.0f}"),
    CPU_1K,
    _metric("CPU s/1k rows, whole pass", lambda r: 1e3 * r.cpu_reader_s / max(1, sum(r.epoch_rows)), "{:.4f}"),
    _metric("peak MB", lambda r: r.peak_rss_bytes / 1e6, "{:,.0f}"),
    _metric("s to first batch", lambda r: r.first_batch_s, "{:.2f}"),
    _metric("s to first batch, from start", lambda r: r.first_batch_from_start_s, "{:.2f}"),
    _metric("row groups/batch", lambda r: r.mix, "{:.1f}"),
]


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


def _select(keys: Sequence[str] | None) -> list[Peer]:
    if not keys:
        return list(PEERS)
    known = {p.key: p for p in PEERS}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(f"unknown peers {unknown}; known: {', '.join(known)}")
    if "fuelline" not in keys:
        keys = ["fuelline", *keys]
    return [known[k] for k in known if k in keys]


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
    """Each peer's one-time copy of the table in its own format; seconds it took (0: reused)."""
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


def _alternate(peers: list[Peer], rounds: int, options: dict[str, Any], logs: Path, timeout: float,
               not_run: dict[str, str]) -> dict[str, list[Round]]:
    """One untimed warm-up pass of each, then ``rounds`` rounds of one pass each, in turn. A peer
    that fails is recorded as not run, with why, and leaves the run."""
    active = [p for p in peers if p.name not in not_run]
    results: dict[str, list[Round]] = {}

    def one(peer: Peer, label: str, seed: int) -> PeerRound | None:
        started = time.perf_counter()
        try:
            r = _round(run_reader(peer, {**options, "seed": seed}, logs / f"{peer.key}.log", timeout))
        except ReaderFailed as exc:
            not_run[peer.name] = f"failed in {label}: {exc}"
            progress(f"{label} {peer.name}: FAILED: {exc}")
            return None
        progress(f"{label} {peer.name}: {r.rows / r.seconds:,.0f} rows/s, {1e3 * r.consumer_cpu_s / r.rows:.4f} CPU s/1k rows, "
                 f"first batch {r.first_batch_s:.2f}s ({r.first_batch_from_start_s:.2f}s from start), "
                 f"{r.mix:.1f} row groups/batch ({time.perf_counter() - started:.0f}s)")
        return r

    for peer in active:
        one(peer, "warm-up", 0)
    for i in range(rounds):
        for peer in active:
            if peer.name in not_run:
                continue
            r = one(peer, f"round {i + 1}/{rounds}", i + 1)
            if r is not None:
                results.setdefault(peer.name, []).append(r)
    return {name: rs for name, rs in results.items() if name not in not_run}


def run(rounds: int, data_dir: Path, results_dir: Path = RESULTS_DIR, quick: bool = False,
        peers: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the peers benchmark, print its table and write peers.json and peers.md; returns the record."""
    env = environment()
    table = dataset.QUICK if quick else dataset.FULL
    root, generation = dataset.ensure(data_dir, table)
    chosen = _select(peers)
    options = {"data": root, "epochs": EPOCHS, "batch_size": BATCH_SIZE, "rows_per_group": table.rows_per_group,
               "rows": table.rows, "shuffle_rows": SHUFFLE_GROUPS * table.rows_per_group}
    not_run: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-peers-") as tmp:
        logs = root / "logs" if not quick else Path(tmp)
        _environments(chosen, quick, logs, not_run)
        prepared = _prepare(chosen, options, logs, not_run)
        cached = _warm_page_cache(root)
        results = _alternate(chosen, rounds, options, logs, QUICK_READER_TIMEOUT_S if quick else READER_TIMEOUT_S, not_run)
    if FUELLINE not in results:
        raise RuntimeError(f"fuelline did not run: {not_run.get(FUELLINE)}")
    ran = [p for p in chosen if p.name in results]
    record, md = _report(results, ran, chosen, not_run, table, rounds, quick, generation, prepared, cached, env)
    print(md, flush=True)
    for path in write_results("peers", record, md, results_dir):
        print(f"wrote {path}", flush=True)
    return record


def _warm_page_cache(root: Path) -> int:
    """Read every file of the table and of the peers' copies once, so that none is first to pay
    for the disk."""
    total = 0
    for path in sorted(root.rglob("*")):
        if path.is_file() and "logs" not in path.parts:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    total += len(chunk)
    return total


def _report(results: dict[str, list[Round]], ran: list[Peer], chosen: list[Peer], not_run: dict[str, str],
            table: dataset.Table, rounds: int, quick: bool, generation: dict[str, Any], prepared: dict[str, float],
            cached: int, env: dict[str, Any]) -> tuple[dict[str, Any], str]:
    others = [p.name for p in ran if p.name != FUELLINE]
    ratios = [RatioSpec(FUELLINE, o, 1.0) for o in others]
    ratios += [RatioSpec(FUELLINE, o, None, metric=CPU_1K.unit, higher=False) for o in others]
    ratios += [RatioSpec(FUELLINE, o, None, metric=METRICS[3].unit, higher=False) for o in others]
    complete = {name: all(d == table.rows for d in r.epoch_distinct_rows)  # type: ignore[attr-defined]
                for name, rs in results.items() for r in rs[:1]}
    incomplete = [name for name, rs in results.items()
                  if any(d != table.rows for r in rs for d in r.epoch_distinct_rows)]  # type: ignore[attr-defined]
    parameters = {
        "rounds": rounds, "quick": quick, "rows": table.rows, "rows_per_group": table.rows_per_group,
        "row_groups": table.groups, "files": table.files, "row_bytes": dataset.ROW_BYTES, "batch_size": BATCH_SIZE,
        "epochs_per_round": EPOCHS, "shuffle_buffer_rows": SHUFFLE_GROUPS * table.rows_per_group,
        "peers": [p.key for p in chosen],
        "order": "one untimed warm-up pass of each, then rounds of " + ", ".join(results),
    }
    versions = {name: venvs.versions(e) for name, e in venvs.ENVS.items() if any(p.env == name for p in ran)}
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
        "CPU s/1k rows: the CPU time of every process of the reader's tree (the reader and all it started: the "
        "fuelline server, DataLoader workers, Ray's GCS, raylet and workers, tf.data's dispatcher and worker), "
        "from /proc (each live process's own time and that of its children that ended), over the same span; "
        "'whole pass': from making the reader to its last batch, over every row delivered, so that work done before "
        "the first batch (a server decoding ahead, a pipeline filling its buffers) counts too (the server's or "
        "cluster's own start-up does not). The 'CPU s/GB' column is the timed span's per GB.",
        "peak MB: the sum of every process's peak resident set (VmHWM); pages shared between processes (fuelline's "
        "shared memory, forked DataLoader workers, memory-mapped files, Ray's object store) count in each.",
        "s to first batch: from making the reader (stream, dataset and loader) to its first batch; 'from start': from "
        "starting its server or cluster (fuelline serve, ray.init, the tf.data servers), the same for those "
        "without one.",
        f"row groups/batch: the mean number of distinct row groups in a full batch (a sequential read: 1, or 2 "
        f"where a batch straddles a boundary; fully random: about {_random_mix(table):.1f}).",
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
        "Ray and tf.data service run in a network namespace of their own with only a loopback interface: both bind "
        "their servers on every interface (Ray even with _node_ip_address='127.0.0.1').",
    ]
    if prepared:
        notes.append("One-time conversions (not timed in rounds): " + ", ".join(
            f"{script.removeprefix('read_').removesuffix('.py')} " + (f"{s:.1f}s" if s else "reused")
            for script, s in prepared.items()) + ".")
    if incomplete:
        notes.append("NOT every row once per epoch: " + ", ".join(incomplete) + ".")
    for name, why in not_run.items():
        notes.append(f"{name}: not run: {why}")
    record, md = build_report(
        "peers", f"peers — {EPOCHS} epochs of a {table.rows:,}-row table, batches of {BATCH_SIZE}, "
        f"{'quick' if quick else 'full'} size", results, METRICS, ratios, parameters, notes, env, exits=_exits(results),
        extra={"not_run": {n: f"not run: {w}" for n, w in not_run.items()}, "generation": generation,
               "prepared_s": prepared, "peer_versions": versions, "every_row_once": complete,
               "processes": {name: rs[-1].processes for name, rs in results.items()}},  # type: ignore[attr-defined]
    )
    return record, md + _summary(record, not_run)


def _exits(results: dict[str, list[Round]]) -> dict[str, dict[str, Any]]:
    """How fuelline's server (one per round) ended on SIGTERM: the first that was not clean, else the last."""
    exits = [r.server_exit for r in results.get(FUELLINE, []) if r.server_exit]  # type: ignore[attr-defined]
    if not exits:
        return {}
    return {"fuelline serve (one a round)": next((e for e in exits if not e.get("clean")), exits[-1])}


def _random_mix(table: dataset.Table) -> float:
    """Expected distinct row groups in a batch of rows drawn uniformly without regard to group."""
    g = table.groups
    return g * (1 - (1 - 1 / g) ** BATCH_SIZE)


def _summary(record: dict[str, Any], not_run: dict[str, str]) -> str:
    whole = METRICS[3].unit
    lines = ["", "### Beside fuelline, round by round", "",
             "| contender | rows/s, median | fuelline / it, per round (min–max) | CPU s/1k rows | it / fuelline, "
             "per round | CPU s/1k rows, whole pass | it / fuelline, per round | row groups/batch |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def inverse(label: str) -> str:
        q = record["ratios"][label]
        return f"{1 / q['of_medians']:.2f} ({1 / q['max_per_round']:.2f}–{1 / q['min_per_round']:.2f})"

    for name, entry in record["contenders"].items():
        if name == FUELLINE:
            speed = cpu = cpu_whole = "1"
        else:
            r = record["ratios"][f"{FUELLINE} / {name}"]
            speed = f"{r['of_medians']:.2f} ({r['min_per_round']:.2f}–{r['max_per_round']:.2f})"
            cpu = inverse(f"{FUELLINE} / {name} ({CPU_1K.unit})")
            cpu_whole = inverse(f"{FUELLINE} / {name} ({whole})")
        lines.append(f"| {name} | {entry['rows/s']['median']:,.0f} | {speed} | {entry[CPU_1K.unit]['median']:.4f} | "
                     f"{cpu} | {entry[whole]['median']:.4f} | {cpu_whole} | {entry['row groups/batch']['median']:.1f} |")
    for name, why in not_run.items():
        lines.append(f"| {name} | not run: {why[:160]} | | | | | | |")
    return "\n".join(lines) + "\n"
