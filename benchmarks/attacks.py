"""``python -m benchmarks.attacks``: what hostile peers cost a data server and its honest clients.

Each attack runs against a real ``fuelline serve`` process (or a ``start_server`` script for the
Fuel-stream attack) on loopback. Rounds alternate: an honest client reads for a few seconds with no
attack, then for as long during the attack. Reported per attack: the server's RSS and thread count
before and at their peak during the attack (sampled every 20 ms), whether it was still serving
afterwards, and the honest client's MB/s and longest gap between two batches, with and without.

Attacks:
  idle-hellos   N connections send a Hello (credit 0, heartbeat 3600 s) and then nothing
  credit-lies   a client grants Credit(2**30) 300 times and reads nothing (--hwm 4, 1 MB batches)
  big-frames    client messages of a type that carries no arrays, each with 100 frames of 1 MiB
  fuel-world    a Hello claiming world size 2**40 to a Fuel-stream server

Results go to ``<results-dir>/attacks.json`` and ``attacks.md``. Figures compare rounds of one run
only; nothing here is a pass/fail test (the tests assert the bounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import zmq

from benchmarks.common import RESULTS_DIR, ServerProcess, progress
from fuelline.client import ServerDataStream
from fuelline.protocol import Credit, Hello, encode

ATTACKS = ("idle-hellos", "credit-lies", "big-frames", "fuel-world")
MIB = 1 << 20


def _status(pid: int) -> tuple[float, int]:
    """(RSS in MB, threads) of a process, from /proc."""
    rss = threads = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return rss / 1024, threads


class Peak(threading.Thread):
    """The highest RSS and thread count of a process while it runs."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.rss, self.threads = _status(pid)
        self._stop_event = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._stop_event.wait(0.02):
            try:
                rss, threads = _status(self.pid)
            except OSError:
                return
            self.rss, self.threads = max(self.rss, rss), max(self.threads, threads)

    def stop(self) -> tuple[float, int]:
        self._stop_event.set()
        self.join(5)
        return self.rss, self.threads


def honest_pass(port: int, seconds: float) -> dict[str, float]:
    """Read for ``seconds``: MB/s after the first batch, and the longest gap between two batches."""
    nbytes, gap, last, first = 0, 0.0, None, None
    with ServerDataStream(host="127.0.0.1", port=port, timeout=30.0, client_id="honest", local=False) as stream:
        while True:
            for batch in stream.get_epoch_iterator():
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    nbytes += sum(a.nbytes for a in batch)
                    gap = max(gap, now - last)
                last = now
                if now - first >= seconds:
                    return {"mb_s": nbytes / (now - first) / 1e6, "max_gap_ms": gap * 1e3}


# -- the attacks: each opens its sockets, returns a function that closes them ----------------------
def _dealer(ctx: zmq.Context, port: int, rcvhwm: int = 1000) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def idle_hellos(ctx: zmq.Context, port: int, n: int) -> Callable[[], None]:
    socks = []
    for i in range(n):
        sock = _dealer(ctx, port)
        sock.send_multipart(encode(Hello(f"idle-{i}", credit=0, heartbeat=3600.0)))
        socks.append(sock)
    return lambda: [s.close(linger=0) for s in socks]


def credit_lies(ctx: zmq.Context, port: int, n: int) -> Callable[[], None]:
    sock = _dealer(ctx, port, rcvhwm=1)  # reads nothing: what the server sends piles up on its side
    sock.send_multipart(encode(Hello("liar", credit=4, heartbeat=3600.0)))
    done = threading.Event()

    def lie() -> None:  # spread out, so that each lie meets batches the last one let through
        for _ in range(n):
            sock.send_multipart(encode(Credit(2**30)))
            if done.wait(0.005):
                return

    liar = threading.Thread(target=lie, daemon=True)
    liar.start()

    def close() -> None:
        done.set()
        liar.join(5)
        sock.close(linger=0)

    return close


def big_frames(ctx: zmq.Context, port: int, n: int) -> Callable[[], None]:
    sock = _dealer(ctx, port)
    sock.setsockopt(zmq.SNDHWM, 0)
    frame = bytes(MIB - 64)  # under the server's per-frame limit
    for _ in range(n):
        sock.send_multipart([encode(Credit(1))[0], *([frame] * 100)], copy=False)
    return lambda: sock.close(linger=0)


def fuel_world(ctx: zmq.Context, port: int, n: int) -> Callable[[], None]:
    sock = _dealer(ctx, port)
    sock.send_multipart(encode(Hello("wide", rank=0, world_size=2**40, credit=1, heartbeat=3600.0)))
    return lambda: sock.close(linger=0)


ATTACK = {"idle-hellos": (idle_hellos, 200), "credit-lies": (credit_lies, 300),
          "big-frames": (big_frames, 10), "fuel-world": (fuel_world, 1)}

FUEL_SCRIPT = """
import numpy as np
from fuelline.server import start_server

class Stream:
    sources = ("features", "label")
    def get_epoch_iterator(self):
        rng = np.random.default_rng(0)
        for _ in range(200):
            yield rng.random((1024, 256), dtype=np.float32), np.zeros(1024, np.int64)

start_server(Stream(), port=0, hwm=4)
"""


def _server(attack: str, data: Path, work: Path) -> ServerProcess:
    if attack == "fuel-world":
        script = work / "fuel_server.py"
        script.write_text(textwrap.dedent(FUEL_SCRIPT))
        argv = [sys.executable, str(script)]
    else:
        argv = [sys.executable, "-m", "fuelline.server.cli", "serve", str(data), "--port", "0", "--hwm", "4",
                "--batch-size", "1024", "--status-interval", "0"]
    return ServerProcess(attack, argv, work / f"{attack}.log")


def run_attack(attack: str, rounds: int, seconds: float, data: Path, work: Path) -> dict[str, Any]:
    make, n = ATTACK[attack]
    ctx = zmq.Context()
    rows: dict[str, list[dict[str, float]]] = {"without": [], "during": []}
    peaks: list[tuple[float, int]] = []
    try:
        with _server(attack, data, work) as server:
            honest_pass(server.port, seconds / 2)  # warm-up: first connection, page cache, decoded units
            before = _status(server.pid)
            for i in range(rounds):
                rows["without"].append(honest_pass(server.port, seconds))
                peak = Peak(server.pid)
                close = make(ctx, server.port, n)
                try:
                    rows["during"].append(honest_pass(server.port, seconds))
                finally:
                    peaks.append(peak.stop())
                    close()
                progress(f"{attack} round {i + 1}/{rounds}: {rows['without'][-1]['mb_s']:.0f} MB/s without, "
                         f"{rows['during'][-1]['mb_s']:.0f} during; peak {peaks[-1][0]:.0f} MB, {peaks[-1][1]} threads")
            alive = server._proc is not None and server._proc.poll() is None  # noqa: SLF001
            stop = server.stop()
    finally:
        ctx.destroy(linger=0)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("mb_s", "max_gap_ms")} for k, v in rows.items()}
    return {
        "attack": attack,
        "size": n,
        "rss_mb_before": round(before[0], 1),
        "rss_mb_peak": round(max(p[0] for p in peaks), 1),
        "threads_before": before[1],
        "threads_peak": max(p[1] for p in peaks),
        "alive_after": alive,
        "sigterm_exit_s": stop.get("exit_s"),
        "honest_mb_s_without": round(med["without"]["mb_s"], 1),
        "honest_mb_s_during": round(med["during"]["mb_s"], 1),
        "honest_ratio": round(statistics.median(d["mb_s"] / w["mb_s"] for d, w in zip(rows["during"], rows["without"])), 3),
        "honest_max_gap_ms_without": round(med["without"]["max_gap_ms"], 1),
        "honest_max_gap_ms_during": round(med["during"]["max_gap_ms"], 1),
        "rounds": rows,
    }


def _markdown(records: Sequence[dict[str, Any]]) -> str:
    head = ("| attack | size | server RSS before → peak (MB) | threads before → peak | alive after | "
            "honest MB/s without / during (ratio) | honest longest gap without / during (ms) |")
    lines = [head, "|" + "---|" * 7]
    for r in records:
        lines.append(
            f"| {r['attack']} | {r['size']} | {r['rss_mb_before']:.0f} → {r['rss_mb_peak']:.0f} | "
            f"{r['threads_before']} → {r['threads_peak']} | {'yes' if r['alive_after'] else 'NO'} | "
            f"{r['honest_mb_s_without']:.0f} / {r['honest_mb_s_during']:.0f} ({r['honest_ratio']:.2f}) | "
            f"{r['honest_max_gap_ms_without']:.1f} / {r['honest_max_gap_ms_during']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attacks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("attack", nargs="*", help=f"which of {', '.join(ATTACKS)} (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per attack (default 3)")
    parser.add_argument("--seconds", type=float, default=3.0, help="honest reading per round (default 3)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    unknown = [a for a in args.attack if a not in ATTACKS]
    if unknown:
        parser.error(f"unknown attack {unknown[0]!r}; choose from {', '.join(ATTACKS)}")
    from fuelline.server.sources.sample import write_sample_dataset

    records = []
    with tempfile.TemporaryDirectory(prefix="fuelline-attacks-") as tmp:
        work = Path(tmp)
        data = work / "data"
        write_sample_dataset(str(data), rows=40_000, dim=256, files=4, row_group_rows=2_000)  # 1 MB batches
        for attack in args.attack or ATTACKS:
            records.append(run_attack(attack, args.rounds, args.seconds, data, work))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "attacks.json").write_text(json.dumps(records, indent=1))
    (args.results_dir / "attacks.md").write_text(_markdown(records))
    print(_markdown(records), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
