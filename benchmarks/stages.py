"""A user's slow preprocessing stage beside an honest client: what it costs the others.

``python -m benchmarks stages [--before REV]``. One ``fuelline serve`` of converted windows with a
stage (``--stage benchmarks.stages:slow_on_val``) that takes SECONDS on every batch of the val split
and nothing on train. An honest client reads train for a fixed span; beside it, a client reads
val, whose every batch takes 0.5, 1.5, 4 or 10 s in the stage (sleeping, as a stage that waits on
a service or a file does; and once burning CPU in numpy, as a heavy feature stage does). Rounds
alternate "alone" (no val client) with each "beside" case. Figures per case: the honest client's
batches/s (and its ratio to alone in the same round), the val client's batches, both clients'
reconnects, and the sessions the server dropped as silent (from its log). Then the time SIGTERM
takes with a stage that never returns.

With ``--before REV``, the same as revision REV serves it (its own ``fuelline convert`` of the
same recordings), for before and after in one run.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS_DIR, ServerProcess, SourceTree, progress
from benchmarks.report import environment, write_results

__all__ = ["run", "slow_on_val", "hangs"]

RECORDINGS, SECONDS, SEED = 12, 60.0, 0
BATCH_SIZE = 8  # as the report that found the livelock
DELAYS = (0.5, 1.5, 4.0, 10.0)
BUSY_DELAY = 1.5  # the CPU-burning case
SPAN_S = 30.0  # each round reads for this long: three batches of the 10 s stage
QUICK_SPAN_S, QUICK_DELAYS = 4.0, (0.5,)
CLIENT_TIMEOUT_S = 120.0
SIGTERM_LIMIT_S = 30.0  # a server still running this long after SIGTERM is killed, and reported so

# -- the stage (imported by the server process from this module) ----------------------------------
_VAL = {int(r) for r in os.environ.get("BENCH_VAL_RECORDINGS", "").split(",") if r}
_DELAY = float(os.environ.get("BENCH_STAGE_SECONDS", "0"))
_BUSY = os.environ.get("BENCH_STAGE_BUSY") == "1"


def slow_on_val(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Takes ``BENCH_STAGE_SECONDS`` on a batch of val windows (sleeping, or with
    ``BENCH_STAGE_BUSY=1`` computing FFTs), nothing on train; the batch is unchanged."""
    if len(batch["sample_id"]) > 2 and _VAL & set((batch["sample_id"] // 1_000_000).tolist()):
        if _BUSY:
            end = time.perf_counter() + _DELAY
            x = np.asarray(batch["eeg"], dtype=np.float32)
            while time.perf_counter() < end:
                np.fft.rfft(np.tile(x, (8, 1, 1)), axis=-1)
        else:
            time.sleep(_DELAY)
    return batch


def hangs(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Never returns on a served batch (the start-up probe of two windows goes through); creates
    the file ``BENCH_STAGE_MARK`` names as it starts to hang."""
    if len(batch["sample_id"]) > 2:
        Path(os.environ["BENCH_STAGE_MARK"]).touch()
    while len(batch["sample_id"]) > 2:
        time.sleep(0.05)
    return batch


# -- measuring -------------------------------------------------------------------------------------
def _val_recordings(dataset: str) -> str:
    from fuelline.server.multimodal.manifest import Manifest
    from fuelline.server.sources.storage import Store

    manifest = Manifest.load(Store(dataset))
    return ",".join(str(i) for i, r in enumerate(manifest.recordings) if r.split == "val")


def _server(name: str, dataset: str, stage: str, log: Path, tree: SourceTree | None, **env: str) -> ServerProcess:
    os.environ.update(env)  # (the server process inherits them)
    argv = [sys.executable, "-m", "fuelline.server.cli", "serve", dataset, "--port", "0", "--batch-size", str(BATCH_SIZE),
            "--stage", f"benchmarks.stages:{stage}", "--status-interval", "0"]
    return ServerProcess(name, argv, log, pythonpath=tree.pythonpath if tree is not None else None)


def _reader(host: str, port: int, split: str, stop: threading.Event, out: dict[str, Any]) -> None:
    from fuelline.client import ServerDataStream

    n = 0
    started = time.monotonic()
    try:
        with ServerDataStream(None, host=host, port=port, split=split, rank=0, world_size=1,
                              timeout=CLIENT_TIMEOUT_S) as stream:
            started = time.monotonic()
            try:
                while not stop.is_set():
                    for _ in stream.get_epoch_iterator():
                        n += 1
                        if stop.is_set():
                            break
            finally:
                out["reconnects"] = stream.reconnects
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    out["batches"] = n
    out["batches_per_s"] = n / max(1e-9, time.monotonic() - started)


def one_round(dataset: str, delay: float | None, busy: bool, span: float, work: Path, tree: SourceTree | None,
              label: str) -> dict[str, Any]:
    """The honest train client for ``span`` seconds, alone (``delay`` None) or beside a val client."""
    env = {"BENCH_STAGE_SECONDS": str(delay or 0.0), "BENCH_STAGE_BUSY": "1" if busy else "0",
           "BENCH_VAL_RECORDINGS": _val_recordings(dataset)}
    log = work / f"server-{label}-{delay}-{'busy' if busy else 'sleep'}-{time.monotonic_ns()}.log"
    with _server(label, dataset, "slow_on_val", log, tree, **env) as server:
        stop = threading.Event()
        honest: dict[str, Any] = {}
        slow: dict[str, Any] = {}
        threads = [threading.Thread(target=_reader, args=(server.host, server.port, "train", stop, honest))]
        if delay is not None:
            threads.append(threading.Thread(target=_reader, args=(server.host, server.port, "val", stop, slow)))
        for t in threads:
            t.start()
        time.sleep(span)  # (the measured span itself)
        stop.set()
        for t in threads:
            t.join(CLIENT_TIMEOUT_S + 30)
    text = log.read_text(errors="replace")
    return {
        "honest_batches_per_s": honest.get("batches_per_s", 0.0),
        "honest_reconnects": honest.get("reconnects"),
        "honest_error": honest.get("error"),
        "slow_batches": slow.get("batches") if delay is not None else None,
        "slow_reconnects": slow.get("reconnects") if delay is not None else None,
        "slow_error": slow.get("error") if delay is not None else None,
        "dropped_silent": len(re.findall(r"dropped: silent", text)),
        "sessions": len(re.findall(r"client \S+: rank \d+ of \d+", text)),
    }


def sigterm_round(dataset: str, work: Path, tree: SourceTree | None, label: str) -> dict[str, Any]:
    """Seconds from SIGTERM to exit of a server whose stage never returns, with a client waiting."""
    from fuelline.client import ServerDataStream

    log = work / f"server-{label}-hang.log"
    mark = work / f"hanging-{label}"
    server = _server(label, dataset, "hangs", log, tree, BENCH_STAGE_MARK=str(mark))
    server.start()
    stream = ServerDataStream(None, host=server.host, port=server.port, rank=0, world_size=1, timeout=CLIENT_TIMEOUT_S)
    asking = threading.Thread(target=lambda: next(iter(stream.get_epoch_iterator()), None), daemon=True)
    asking.start()
    deadline = time.monotonic() + 60
    while not mark.exists():  # (the client's first batch is in the stage)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{label}: no batch reached the hanging stage within 60 s")
        time.sleep(0.05)
    proc = server._proc
    assert proc is not None
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(SIGTERM_LIMIT_S)
        killed = False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        killed = True
    took = time.monotonic() - started
    server.exit_status = {"done": True}
    stream.close()
    text = log.read_text(errors="replace")
    named = re.search(r"stopping without stage (\S+),", text)
    return {"seconds": round(took, 2), "killed_after_limit": killed, "exit_code": proc.returncode,
            "stage_named": named.group(1) if named else None}


def run(rounds: int, data_dir: Path, results: Path = RESULTS_DIR, quick: bool = False,
        before: str | None = None) -> dict[str, Any]:
    from fuelline.server.ingest.convert import convert
    from fuelline.server.ingest.synth import synthesize

    span = QUICK_SPAN_S if quick else SPAN_S
    delays = QUICK_DELAYS if quick else DELAYS
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fuelline-bench-stages-")))
        raw = data_dir / f"raw-stages-{RECORDINGS}rec-{int(SECONDS)}s-seed{SEED}"
        if not raw.is_dir():
            data_dir.mkdir(parents=True, exist_ok=True)
            synthesize(str(raw), RECORDINGS, SECONDS, SEED)
        sides: dict[str, tuple[str, SourceTree | None]] = {}
        convert(str(raw), str(work / "converted"), val_fraction=0.3, seed=0, progress=False)
        sides["after"] = (str(work / "converted"), None)
        if before is not None:
            tree = stack.enter_context(SourceTree(before, work))
            tree.run("convert", str(raw), str(work / "converted-before"), "--val-fraction", "0.3", "--seed", "0")
            sides["before"] = (str(work / "converted-before"), tree)
        cases: list[tuple[float | None, bool]] = [(None, False), *[(d, False) for d in delays]]
        if not quick:
            cases.append((BUSY_DELAY, True))
        figures: dict[str, dict[str, list[dict[str, Any]]]] = {side: {} for side in sides}
        for i in range(rounds):
            for delay, busy in cases:
                for side, (dataset, tree) in sides.items():
                    case = "alone" if delay is None else f"{delay:g} s {'busy' if busy else 'sleep'}"
                    r = one_round(dataset, delay, busy, span, work, tree, side)
                    figures[side].setdefault(case, []).append(r)
                    progress(f"round {i + 1}/{rounds} {side} {case}: honest {r['honest_batches_per_s']:.1f} batches/s, "
                             f"slow {r['slow_batches']} batches, reconnects {r['honest_reconnects']}/{r['slow_reconnects']}, "
                             f"dropped silent {r['dropped_silent']}")
        sigterm = {side: sigterm_round(dataset, work, tree, side) for side, (dataset, tree) in sides.items()}
        for side, r in sigterm.items():
            progress(f"SIGTERM with a hanging stage, {side}: {r}")
    summary = {side: _summarise(cases) for side, cases in figures.items()}
    record = {"benchmark": "stages", "environment": environment(), "rounds": rounds, "span_s": span,
              "batch_size": BATCH_SIZE, "before": before, "cases": figures, "summary": summary, "sigterm": sigterm}
    write_results("stages", record, _markdown(record), results)
    return record


def _summarise(cases: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    alone = [r["honest_batches_per_s"] for r in cases.get("alone", [])]
    out = {}
    for case, runs in cases.items():
        rates = [r["honest_batches_per_s"] for r in runs]
        ratios = [r / a for r, a in zip(rates, alone) if a]
        out[case] = {
            "honest_batches_per_s": statistics.median(rates),
            "ratio_to_alone": statistics.median(ratios) if ratios else None,
            "ratio_range": [min(ratios), max(ratios)] if ratios else None,
            "slow_batches": [r["slow_batches"] for r in runs],
            "reconnects": [[r["honest_reconnects"], r["slow_reconnects"]] for r in runs],
            "dropped_silent": [r["dropped_silent"] for r in runs],
            "errors": [e for r in runs for e in (r["honest_error"], r["slow_error"]) if e],
        }
    return out


def _markdown(record: dict[str, Any]) -> str:
    lines = [f"# A slow stage beside an honest client ({record['rounds']} rounds of {record['span_s']:g} s, "
             f"batch {record['batch_size']})", ""]
    for side, cases in record["summary"].items():
        lines += [f"## {side}{' (' + record['before'] + ')' if side == 'before' else ''}", "",
                  "| val stage | honest batches/s | / alone (range) | val batches | reconnects honest/val | dropped silent |",
                  "|---|---:|---:|---|---|---|"]
        for case, s in cases.items():
            ratio = "" if s["ratio_to_alone"] is None else f"{s['ratio_to_alone']:.2f} ({s['ratio_range'][0]:.2f}-{s['ratio_range'][1]:.2f})"
            lines.append(f"| {case} | {s['honest_batches_per_s']:.1f} | {ratio} | {s['slow_batches']} | "
                         f"{s['reconnects']} | {s['dropped_silent']} |")
        lines.append("")
    lines += ["## SIGTERM with a stage that never returns", "", "| side | seconds to exit | exit code | killed | stage named |",
              "|---|---:|---:|---|---|"]
    for side, r in record["sigterm"].items():
        lines.append(f"| {side} | {r['seconds']} | {r['exit_code']} | {r['killed_after_limit']} | {r['stage_named']} |")
    return "\n".join(lines) + "\n"
