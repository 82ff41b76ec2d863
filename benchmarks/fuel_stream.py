"""The Fuel stream: what a Fuel user sees first, fuelline against Fuel 0.2 itself (and, with
``--before REV``, against another revision of fuelline), in one run.

``python -m benchmarks fuel-stream [--before REV]``: a Fuel-style stream yielding the same 3 MB
array object for every batch, served by ``start_server(stream, hwm=10)`` and read by a default
``ServerDataStream`` on the same host (which moves to the server's Unix socket and shared memory),
and by one that stays on TCP (``local=False``, as a client on another host reads). Fuel 0.2 runs
from its own virtual environment (``benchmarks/.venvs/fuel-0.2``, made on first use from the
package index), its server and its client as it ships them. Every round starts each server
anew and reads one epoch from its first batch: the first pass over a stream, as a user's first
epoch is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import BENCH_DIR, RESULTS_DIR, Contender, Round, ServerProcess, SourceTree, alternate, progress
from benchmarks.report import Metric, RatioSpec, build_report, environment, write_results

__all__ = ["run", "fuel_environment", "FUELLINE", "FUELLINE_TCP", "FUEL"]

ENDS = BENCH_DIR / "fuel_stream_ends.py"
ROWS = 256  # rows of a batch (256 × 3000 float32)
READ_TIMEOUT_S = 300.0
FUEL_VERSION = "0.2.0"
# Fuel 0.2's server and client import these; pinned so the environment is the same every time.
FUEL_DEPENDENCIES = ("numpy==2.4.6", "pyzmq==27.3.0", "six==1.17.0", "PyYAML==6.0.4", "h5py==3.16.0",
                     "picklable-itertools==0.1.1")

FUELLINE, FUELLINE_TCP, FUEL = "fuelline", "fuelline, TCP", "Fuel 0.2"


FUEL_ROOT = BENCH_DIR / ".venvs" / f"fuel-{FUEL_VERSION[:3]}"


def fuel_environment(root: Path = FUEL_ROOT, make: bool = True) -> tuple[str, str]:
    """(python, PYTHONPATH) of Fuel 0.2, made on first use: a virtual environment with its
    dependencies, and Fuel's own source from its sdist (its one C extension, an image transformer,
    is not built: neither end of the stream uses it). Raises RuntimeError saying what failed, or
    that it is not made yet where ``make`` is False."""
    python = root / "bin" / "python"
    source = root / "src" / f"fuel-{FUEL_VERSION}"
    if python.exists() and (source / "fuel" / "server.py").exists():
        return str(python), str(source)
    if not make:
        raise RuntimeError(f"its environment is not made yet ({root}; a run without --quick makes it)")

    def step(*argv: str) -> None:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if done.returncode:
            raise RuntimeError(f"making Fuel {FUEL_VERSION}'s environment: {' '.join(argv)} exited "
                               f"{done.returncode}: {done.stderr[-1500:]}")

    progress(f"making Fuel {FUEL_VERSION}'s environment in {root}")
    step(sys.executable, "-m", "venv", str(root))
    step(str(python), "-m", "pip", "install", "-q", *FUEL_DEPENDENCIES)
    with tempfile.TemporaryDirectory() as tmp:
        step(str(python), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", tmp,
             f"fuel=={FUEL_VERSION}")
        (sdist,) = Path(tmp).glob("fuel-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(root / "src", filter="data")
    return str(python), str(source)


def _round(name: str, server_argv: list[str], reader_argv: list[str], pythonpath: str | None, logs: Path,
           batches: int) -> Round:
    """Start a server, read ``batches`` batches with a reader process, stop the server."""
    with ServerProcess(name, server_argv, logs / f"{name.replace(' ', '_').replace(',', '')}.log",
                       pythonpath=pythonpath) as server:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
        done = subprocess.run([*reader_argv, str(server.port), str(batches), *(["--tcp"] if "TCP" in name else [])],
                              capture_output=True, text=True, timeout=READ_TIMEOUT_S, env=env)
    if done.returncode:
        raise RuntimeError(f"{name}: the reader exited {done.returncode}: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if out["batches"] != batches:
        raise RuntimeError(f"{name}: {out['batches']} batches arrived, expected {batches}")
    transport = out.get("transport", "tcp://")
    if ("TCP" in name or name == FUEL) != transport.startswith("tcp://"):
        raise RuntimeError(f"{name}: read through {transport}")
    return Round(batches=batches, rows=(batches - 1) * ROWS, bytes=out["bytes"], seconds=out["seconds"],
                 consumer_cpu_s=out["cpu_s"], producer_cpu_s=None)


def run(rounds: int, batches: int, results_dir: Path = RESULTS_DIR, before: str | None = None,
        quick: bool = False) -> dict[str, Any]:
    """Run the benchmark, print its table and write its results; returns the record. ``quick``
    runs Fuel 0.2 only where its environment is made already (it reaches no package index)."""
    from benchmarks import plots

    env = environment()
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-") as tmp, ExitStack() as stack:
        logs = Path(tmp)
        here = [sys.executable, str(ENDS)]
        plan: list[tuple[str, list[str], list[str], str | None]] = [
            (FUELLINE, [*here, "serve", "fuelline", str(batches)], [*here, "read", "fuelline"], None),
            (FUELLINE_TCP, [*here, "serve", "fuelline", str(batches)], [*here, "read", "fuelline"], None),
        ]
        skipped: dict[str, str] = {}
        if before:
            tree = stack.enter_context(SourceTree(before, logs))
            for name in (f"{before}", f"{before}, TCP"):
                plan.append((name, [*here, "serve", "fuelline", str(batches)], [*here, "read", "fuelline"], tree.pythonpath))
        try:
            python, path = fuel_environment(make=not quick)
            plan.append((FUEL, [python, str(ENDS), "serve", "fuel", str(batches)], [python, str(ENDS), "read", "fuel"], path))
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            skipped[FUEL] = str(exc)
            progress(f"{FUEL}: not run: {exc}")

        def contender(name: str, server: list[str], reader: list[str], path: str | None) -> Callable[[], Round]:
            return lambda: _round(name, server, reader, path, logs, batches)

        contenders = [Contender(name, contender(name, s, r, p)) for name, s, r, p in plan]
        gbps = Metric("GB/s", lambda r: r.bytes / r.seconds / 1e9, "{:.3f}")
        results = alternate(contenders, rounds, lambda r: f"{gbps.of(r):.3f} GB/s")
    ratios = [RatioSpec(FUELLINE_TCP, FUELLINE)]
    if FUEL in results:
        ratios[:0] = [RatioSpec(FUELLINE, FUEL, 2.5), RatioSpec(FUELLINE_TCP, FUEL)]
    if before:
        ratios += [RatioSpec(FUELLINE, before, 1.0), RatioSpec(FUELLINE_TCP, f"{before}, TCP", 1.0)]
    batch_bytes = ROWS * 3000 * 4
    parameters = {"rounds": rounds, "batches_per_round": batches, "batch_bytes": batch_bytes, "hwm": 10,
                  "before": before, "fuel_version": FUEL_VERSION if FUEL in results else None}
    notes = [
        f"{rounds} rounds of {batches} batches of {batch_bytes / 1e6:.3f} MB (the same 256×3000 float32 array object "
        "yielded for every batch); contenders run alternately, each round after one untimed warm-up of each. Every "
        "round starts its server anew and reads the first pass of its first epoch.",
        "fuelline: start_server(stream, port=0, hwm=10), default options (each batch copied once as it is read, "
        "checksummed in the same pass; checksums on); a default ServerDataStream on the same host (moves to the "
        "Unix socket and shared memory), and one with local=False (TCP, as from another host).",
        f"Fuel {FUEL_VERSION}: its own send_arrays / ServerDataStream from its sdist in its own virtual environment, "
        "start_server's loop (logging a line per batch at INFO, as it does) on a socket bound to 127.0.0.1.",
        "A rate counts the batches after the first over the time from the first batch's arrival to the last's; "
        "every array is touched (one element read). Readers are separate processes, one per round.",
    ]
    if skipped:
        notes += [f"{name}: not run: {why}" for name, why in skipped.items()]
    record, md = build_report("fuel-stream", "Fuel stream — 3 MB batches of one reused array, first pass",
                              results, [gbps], ratios, parameters, notes, env, exits={})
    print(md, flush=True)
    for path in write_results("fuel-stream", record, md, results_dir):
        print(f"wrote {path}", flush=True)
    print(f"wrote {plots.for_record(record, results_dir)}", flush=True)
    return record
