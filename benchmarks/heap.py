"""Heap: what a reader's heap settings (``fuelline.client.heap``) change, each reader in a process of its own.

malloc's thresholds belong to a process, so every pass reads in a fresh one: fuelline's reader over
TCP (start_server's default, and ``fresh_arrays=True``) and bare pyzmq's receiver, each with glibc's
defaults (``FUELLINE_HEAP=system``) and with the heap set as a fuelline reader sets it from its first
batch (bare pyzmq's receiver sets it by hand before it receives), in alternating rounds. Per pass:
GB/s, and the receiving process's page faults and CPU per batch. The senders are the transport
benchmark's.

``python -m benchmarks heap [--rounds N] [--batches N]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from benchmarks.common import RESULTS_DIR, ROOT, Contender, Round, alternate, time_batches
from benchmarks.report import Metric, RatioSpec, build_report, environment, write_results

__all__ = ["run"]

SYSTEM, TUNED = "glibc's defaults", "fuelline's heap"
KINDS = ("bare pyzmq", "fuelline", "fuelline, fresh_arrays")
TIMEOUT_S = 120.0


@dataclass(frozen=True)
class HeapRound(Round):
    """A pass, with the receiving process's minor page faults over its timed span."""

    faults: int = field(default=0, kw_only=True)
    peak_rss_mb: float = field(default=0.0, kw_only=True)  # the reading process's, at the pass's end


def _minor_faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _counting(batches: Iterable[Any], counts: list[int]) -> Iterator[Any]:
    """Pass the batches on; ``counts`` gets the faults when the first arrives and after the last."""
    for batch in batches:
        if not counts:
            counts.append(_minor_faults())
        yield batch
    counts.append(_minor_faults())


def read(kind: str, endpoint: str, batches: int, server_pid: int = 0) -> dict[str, Any]:
    """One pass in this process (a fresh one, its heap as its environment says): the Round, as a dict."""
    from benchmarks import transport
    from fuelline.client import ServerDataStream, heap

    counts: list[int] = []
    if kind == "bare pyzmq":
        heap.hold("bare pyzmq", transport.HWM * int(np.prod(transport.SHAPE)) * np.dtype(transport.DTYPE).itemsize)
        with transport.BareSender() as sender:
            r = time_batches(_counting(sender.receive(batches), counts), producer_pid=sender.pid)
        if not sender.exit_status["clean"]:
            raise RuntimeError(f"bare pyzmq sender: {sender.exit_status}")
    else:
        host, port = endpoint.rsplit(":", 1)
        with ServerDataStream(("features",), host=host, port=int(port), hwm=transport.HWM, timeout=TIMEOUT_S,
                              receive_timeout=TIMEOUT_S, local=False) as stream:
            r = time_batches(_counting(stream.get_epoch_iterator(), counts), producer_pid=server_pid)
    return {**asdict(r), "faults": counts[-1] - counts[0], "peak_rss_mb": _peak_rss_mb(), "held": heap.held()}


def _pass(kind: str, endpoint: str, server_pid: int, batches: int, tuned: bool) -> HeapRound:
    env = {k: v for k, v in os.environ.items() if k != "FUELLINE_HEAP"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if not tuned:
        env["FUELLINE_HEAP"] = "system"
    done = subprocess.run([sys.executable, "-m", "benchmarks.heap", "--read", kind, endpoint, str(batches), str(server_pid)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"heap: {kind} ({'tuned' if tuned else 'system'}) failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if (out.pop("held") > 0) != tuned:
        raise RuntimeError(f"heap: {kind} read with the heap {'left alone' if tuned else 'set'}, expected otherwise")
    out.pop("threads_cpu_s", None)
    return HeapRound(**out)


def run(rounds: int, batches: int, results_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """Run the heap benchmark, print its table and write its results; returns the record."""
    from benchmarks import plots, transport

    env = environment()
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-") as logs, ExitStack() as stack:
        default = stack.enter_context(transport.fuelline_server("fuelline", batches, True, Path(logs)))
        fresh = stack.enter_context(transport.fuelline_server("fresh", batches, True, Path(logs), fresh_arrays=True))
        servers = {"bare pyzmq": ("", 0), "fuelline": (f"{default.host}:{default.port}", default.pid),
                   "fuelline, fresh_arrays": (f"{fresh.host}:{fresh.port}", fresh.pid)}
        contenders = [Contender(f"{kind}, {setting}",
                                lambda kind=kind, tuned=(setting == TUNED): _pass(kind, *servers[kind], batches, tuned))
                      for kind in KINDS for setting in (SYSTEM, TUNED)]
        gbps = Metric("GB/s", lambda r: r.bytes / r.seconds / 1e9, "{:.3f}")
        faults = Metric("page faults/batch", lambda r: r.faults / (r.batches - 1), "{:.1f}")  # type: ignore[attr-defined]
        cpu = Metric("receiver CPU ms/batch", lambda r: 1e3 * r.consumer_cpu_s / (r.batches - 1), "{:.3f}")
        rss = Metric("receiver peak RSS MB", lambda r: r.peak_rss_mb, "{:.0f}")  # type: ignore[attr-defined]
        results = alternate(contenders, rounds, lambda r: f"{gbps.of(r):.3f} GB/s, {faults.of(r):.0f} faults/batch")
        stack.close()  # stop the servers now: their exit status belongs in the record
        # (Each pass's bare pyzmq sender is checked to have exited cleanly where it ran.)
        exit_of = {"fuelline": default.exit_status, "fuelline, fresh_arrays": fresh.exit_status,
                   "bare pyzmq": {"exit_code": 0, "killed": False, "clean": True}}
        exits = {f"{kind}, {setting}": exit_of[kind] for kind in KINDS for setting in (SYSTEM, TUNED)}
    ratios: list[RatioSpec] = []
    for kind in KINDS:
        ratios += [RatioSpec(f"{kind}, {TUNED}", f"{kind}, {SYSTEM}"),
                   RatioSpec(f"{kind}, {TUNED}", f"{kind}, {SYSTEM}", metric=rss.unit, higher=False),
                   RatioSpec(f"{kind}, {TUNED}", f"{kind}, {SYSTEM}", metric=faults.unit, higher=False),
                   RatioSpec(f"{kind}, {TUNED}", f"{kind}, {SYSTEM}", metric=cpu.unit, higher=False)]
    for kind in KINDS[1:]:
        ratios += [RatioSpec(f"{kind}, {TUNED}", f"bare pyzmq, {SYSTEM}"), RatioSpec(f"{kind}, {SYSTEM}", f"bare pyzmq, {SYSTEM}")]
    batch_bytes = int(np.prod(transport.SHAPE)) * np.dtype(transport.DTYPE).itemsize
    parameters = {"rounds": rounds, "batches_per_round": batches, "batch_bytes": batch_bytes, "hwm": transport.HWM,
                  "order": "one untimed warm-up pass of each, then rounds of " + ", ".join(c.name for c in contenders)}
    notes = [
        f"{rounds} timed rounds of {batches} batches of {batch_bytes / 1e6:.3f} MB over tcp loopback, each pass "
        "read by a new process (python -m benchmarks.heap --read), contenders alternating, after one untimed "
        "warm-up pass of each.",
        f"{SYSTEM}: the reader runs with FUELLINE_HEAP=system, so malloc keeps glibc's adjusting thresholds. "
        f"{TUNED}: a fuelline reader raises glibc's trim threshold to twice what its connections may hold in "
        "flight and fixes the mmap threshold at 32 MB from its first batch (fuelline.client.heap); bare pyzmq's "
        "receiver does the same by hand before its first batch.",
        "The senders are the transport benchmark's: bare pyzmq's PUSH of one preallocated array (a child of the "
        "reader), and start_server(stream, hwm=10) of its repeated array, copied and checksummed per batch by "
        "default, sent as it is with fresh_arrays=True (checksummed).",
        "Page faults: the receiving process's minor faults from its first batch to its last, per batch; CPU: its "
        "CPU time over the same span (all its threads, libzmq's I/O thread included, which receives into the "
        "buffers that fault). CPU s/GB adds the sending process's (the server, or bare pyzmq's sender). Peak RSS: "
        "the reading process's high-water mark (VmHWM) at the end of its pass: what the memory it keeps costs.",
    ]
    record, md = build_report("heap", "heap — a reader's receive buffers, glibc's defaults against fuelline's",
                              results, [gbps, faults, cpu, rss], ratios, parameters, notes, env, exits=exits)
    print(md, flush=True)
    for path in write_results("heap", record, md, results_dir):
        print(f"wrote {path}", flush=True)
    print(f"wrote {plots.for_record(record, results_dir)}", flush=True)
    return record


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["--read"]:
        kind, endpoint, batches, server_pid = argv[1], argv[2], int(argv[3]), int(argv[4])
        print(json.dumps(read(kind, endpoint, batches, server_pid)), flush=True)
        return 0
    raise SystemExit("usage: python -m benchmarks heap [--rounds N] [--batches N]")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
