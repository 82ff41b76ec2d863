"""What the client costs a training step: a reader that "trains" 3 ms after every batch, with this
tree's client and, with ``--before REV``, another revision's, alternately, in one run.

    python -m benchmarks.training_step [--before REV] [--rounds 5] [--batches 300]

One ``start_server`` of a Fuel-style stream of 3 MB batches (this tree's server) serves every
reader. Each reader is a process of its own, on the server's host (shared memory) or over TCP
(``local=False``), and its step either holds the interpreter lock (a busy Python loop, as a
training step's Python does) or releases it (``time.sleep``, as a step that waits on a GPU). The
figure is the reader's time over the steps' own (3 ms × batches): what the client's threads take
from the step, the keep-alive thread's turns among them, plus any wait for data. Printed as a
table of per-round medians; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks.common import ROOT, ServerProcess, SourceTree, progress

__all__ = ["main"]

STEP_S = 0.003

SERVER = """
import numpy as np
from fuelline.server import start_server

class Repeated:
    sources = ("x",)

    def __init__(self):
        self.array = np.ones((256, 3000), np.float32)

    def get_epoch_iterator(self, **kwargs):
        return ((self.array,) for _ in range(10_000_000))

start_server(Repeated(), port=0, hwm=10, host="127.0.0.1")
"""

READER = """
import json, sys, time
from fuelline.client import ServerDataStream

port, local, holds, batches, step = int(sys.argv[1]), sys.argv[2] == "host", sys.argv[3] == "holds", int(sys.argv[4]), float(sys.argv[5])

def train():
    if not holds:
        time.sleep(step)
        return
    end = time.perf_counter() + step
    while time.perf_counter() < end:
        pass

with ServerDataStream(("x",), host="127.0.0.1", port=port, hwm=10, timeout=60, receive_timeout=60, local=local) as s:
    it = s.get_epoch_iterator()
    next(it)
    waited, started = 0.0, time.perf_counter()
    for _ in range(batches):
        t = time.perf_counter()
        next(it)
        waited += time.perf_counter() - t
        train()
    took = time.perf_counter() - started
print(json.dumps({"ratio": took / (batches * step), "wait_us": waited / batches * 1e6}))
"""


def _read(pythonpath: str | None, port: int, path: str, step: str, batches: int) -> dict[str, float]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run([sys.executable, "-c", READER, str(port), path, step, str(batches), str(STEP_S)], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"reader exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", metavar="REV", help="also read with this revision's client")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fuelline-step-") as tmp, ExitStack() as stack:
        script = Path(tmp) / "server.py"
        script.write_text(textwrap.dedent(SERVER))
        server = stack.enter_context(ServerProcess("server", [sys.executable, str(script)], Path(tmp) / "server.log"))
        clients = [("this tree", None)]
        if args.before:
            clients.insert(0, (args.before, stack.enter_context(SourceTree(args.before, Path(tmp))).pythonpath))
        cells = [(step, path) for step in ("holds", "releases") for path in ("host", "tcp")]
        results: dict[tuple[str, str, str], list[dict[str, float]]] = {}
        for r in range(args.rounds + 1):  # (the first, a warm-up, is not counted)
            for step, path in cells:
                for name, pythonpath in clients:
                    got = _read(pythonpath, server.port, path, step, args.batches)
                    if r:
                        results.setdefault((step, path, name), []).append(got)
            progress(f"round {r}/{args.rounds} done" if r else "warm-up done")
    names = [name for name, _ in clients]
    print(f"\n3 ms steps after each of {args.batches} batches of 3 MB; time / the steps' own, per-round medians "
          f"({args.rounds} rounds), and the wait per batch\n")
    print("| step | path | " + " | ".join(names) + " |")
    print("|---|---|" + "---:|" * len(names))
    for step, path in cells:
        row = []
        for name in names:
            rounds = results[(step, path, name)]
            row.append(f"{statistics.median(x['ratio'] for x in rounds):.3f} "
                       f"({statistics.median(x['wait_us'] for x in rounds):.0f} µs)")
        print(f"| {step} the GIL | {path} | " + " | ".join(row) + " |")
    print(f"\n{time.strftime('%Y-%m-%dT%H:%M:%S')}; {os.cpu_count()} CPUs; source {ROOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
