"""Partitions between trainer hosts and a data host (benchmarks/bed.py), as a seeded schedule: cuts
of a reader's host or of the data host, short blips or cuts held until a reader says it noticed
the silence, at drawn moments of two epochs. Every rank's epochs must be those it reads without
them, every batch once and in order, and a reader that noticed a cut must have reconnected."""

from __future__ import annotations

import json
import queue
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks.bed import Bed, unavailable
from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize

from support.processes import ServerProcess

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

READER = """
import json, logging, sys, time
from fuelline.client import ServerDataStream
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
rank, world, epochs = (int(a) for a in sys.argv[2:5])
step = float(sys.argv[5])  # seconds of "training" per batch
stream = ServerDataStream(["sample_id"], host=sys.argv[1], port=5557, hwm=2, rank=rank, world_size=world,
                          heartbeat=0.5, timeout=60)
for _ in range(epochs):
    for batch in stream.get_epoch_iterator(as_dict=True):
        print(json.dumps(batch["sample_id"].tolist()), flush=True)
        time.sleep(step)
print(json.dumps({"reconnects": stream.reconnects}), flush=True)
"""


def _pump(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def _read(bed: Bed, host: int, server: str, rank: int = 0, world: int = 1, epochs: int = 1,
          step: float = 0.0) -> tuple[subprocess.Popen, queue.Queue, queue.Queue]:
    argv = [sys.executable, "-c", READER, server, str(rank), str(world), str(epochs), str(step)]
    proc = subprocess.Popen(bed.hosts[host].command(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: queue.Queue = queue.Queue()
    err: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, out), daemon=True).start()
    threading.Thread(target=_pump, args=(proc.stderr, err), daemon=True).start()
    return proc, out, err


def _lines(q: queue.Queue, deadline: float) -> list:
    got = []
    while (line := q.get(timeout=max(0.1, deadline - time.monotonic()))) is not None:
        got.append(json.loads(line))
    return got


def _drain(q: queue.Queue) -> str:
    text = []
    while True:
        try:
            line = q.get(timeout=5)
        except queue.Empty:
            break
        if line is None:
            break
        text.append(line)
    return "".join(text)[-3000:]


def _serve(bed: Bed, tmp_path: Path) -> ServerProcess:
    synthesize(str(tmp_path / "raw"), 12, 20.0, 2, video_dim=8, drop=0.001)
    convert(str(tmp_path / "raw"), str(tmp_path / "data"), progress=False)
    host = bed.hosts[0]
    argv = [sys.executable, "-m", "fuelline.server.cli", "serve", str(tmp_path / "data"), "--host", host.address,
            "--port", "5557", "--batch-size", "4", "--seed", "3", "--heartbeat", "0.5", "--insecure"]
    return ServerProcess(host.command(argv), tmp_path / "server.log")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_schedule_of_partitions_leaves_every_ranks_epochs_as_they_were(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    world, epochs = 2, 2
    with Bed(1 + world, rate="50mbit") as bed:  # host 0 serves; rank r reads on host 1 + r
        server = _serve(bed, tmp_path)
        try:
            deadline = time.monotonic() + 200
            readers = [_read(bed, 1 + r, bed.hosts[0].address, r, world, epochs) for r in range(world)]
            reference = [_lines(out, deadline)[:-1] for _, out, _ in readers]
            assert all(proc.wait(30) == 0 for proc, _, _ in readers)
            total = sum(map(len, reference))
            # Three faults, each once the ranks have delivered a drawn number of batches in all.
            moments = sorted(rng.sample(range(1, total - 2), 3))
            schedule = [(at, rng.choice([0, 1, 2]), rng.choice(["blip", "noticed"]), rng.uniform(0.2, 1.0))
                        for at in moments]

            # Each rank "trains" 50 ms a batch, so that the faults fall through the run.
            readers = [_read(bed, 1 + r, bed.hosts[0].address, r, world, epochs, 0.05) for r in range(world)]
            got: list[list] = [[] for _ in range(world)]
            finished = [False] * world
            noticers: set[int] = set()  # ranks that said they noticed a cut

            def take(block: float) -> None:
                """Move what the readers printed into ``got`` (waiting up to ``block`` for a line)."""
                for r, (_, out, _) in enumerate(readers):
                    try:
                        line = out.get(timeout=block)
                    except queue.Empty:
                        continue
                    if line is None:
                        finished[r] = True
                    else:
                        got[r].append(json.loads(line))

            for at, host, kind, seconds in schedule:
                # (Progress counts what the readers printed, taken or still queued.)
                while sum(len(got[r]) + readers[r][1].qsize() for r in range(world)) < at and not all(finished):
                    assert time.monotonic() < deadline, f"seed {seed}: no progress to {at} batches"
                    take(0.05)
                bed.partition(host)
                try:
                    if kind == "blip":
                        time.sleep(seconds)  # the fault's drawn length, not a wait for anything
                    else:
                        # Cut until a reader behind the cut says it noticed, or every one has ended.
                        cut = [r for r in range(world) if host in (0, 1 + r)]
                        noticed = False
                        while not noticed and not all(finished[r] for r in cut):
                            assert time.monotonic() < deadline, f"seed {seed}: the cut went unnoticed"
                            for r in cut:
                                try:
                                    said = readers[r][2].get(timeout=0.05) or ""
                                except queue.Empty:
                                    continue
                                if "silent for" in said:
                                    noticed = True
                                    noticers.add(r)
                            take(0.0)
                finally:
                    bed.heal(host)
            while not all(finished):
                assert time.monotonic() < deadline, f"seed {seed}: the readers did not finish after {schedule}"
                take(0.1)
            assert all(proc.wait(30) == 0 for proc, _, _ in readers), [_drain(err) for _, _, err in readers]
        finally:
            server.terminate()
    for r in range(world):
        assert got[r][:-1] == reference[r], f"seed {seed}, rank {r}, schedule {schedule}"
        if r in noticers:  # a cut it noticed made it reconnect, and it still lost nothing
            assert got[r][-1]["reconnects"] >= 1
