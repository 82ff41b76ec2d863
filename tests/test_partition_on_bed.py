"""A partition between a trainer host and a data host (benchmarks/bed.py): the reader notices the
silence, reconnects once the link is back, and its epoch is the one it would have read without
the partition, every batch once."""

from __future__ import annotations

import json
import queue
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
import json, logging, sys
from fuelline.client import ServerDataStream
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
stream = ServerDataStream(["sample_id"], host=sys.argv[1], port=5557, hwm=2, rank=0, world_size=1, heartbeat=0.5,
                          timeout=60)
for batch in stream.get_epoch_iterator(as_dict=True):
    print(json.dumps(batch["sample_id"].tolist()), flush=True)
print(json.dumps({"reconnects": stream.reconnects}), flush=True)
"""


def _pump(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def _read(bed: Bed, host: int, server: str) -> tuple[subprocess.Popen, queue.Queue, queue.Queue]:
    proc = subprocess.Popen(bed.hosts[host].command([sys.executable, "-c", READER, server]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
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


@pytest.mark.timeout(300)
def test_a_reader_cut_off_from_its_server_resumes_its_epoch_once_the_link_is_back(tmp_path: Path) -> None:
    synthesize(str(tmp_path / "raw"), 12, 20.0, 2, video_dim=8, drop=0.001)
    convert(str(tmp_path / "raw"), str(tmp_path / "data"), progress=False)
    with Bed(2, rate="50mbit") as bed:
        data_host = bed.hosts[0]
        argv = [sys.executable, "-m", "fuelline.server.cli", "serve", str(tmp_path / "data"), "--host",
                data_host.address, "--port", "5557", "--batch-size", "4", "--seed", "3", "--heartbeat", "0.5",
                "--hwm", "2", "--insecure"]
        server = ServerProcess(data_host.command(argv), tmp_path / "server.log")
        try:
            deadline = time.monotonic() + 120
            reference, out, err = _read(bed, 1, data_host.address)
            whole = _lines(out, deadline)
            assert reference.wait(30) == 0, _drain(err)
            batches, stats = whole[:-1], whole[-1]
            # Far more batches than the reader holds (hwm 2): most must cross the link after the cut.
            assert len(batches) >= 10 and stats == {"reconnects": 0}

            reader, out, err = _read(bed, 1, data_host.address)
            got = [json.loads(out.get(timeout=60)) for _ in range(3)]
            bed.partition(1)
            try:
                # Cut off until the reader has noticed the silence (its own words), then healed.
                while True:
                    line = err.get(timeout=max(0.1, deadline - time.monotonic()))
                    assert line is not None, "the reader ended without noticing the partition"
                    if "silent for" in line:
                        break
            finally:
                bed.heal(1)
            rest = _lines(out, deadline)
            assert reader.wait(30) == 0, _drain(err)
        finally:
            server.terminate()
    got += rest[:-1]
    assert rest[-1]["reconnects"] >= 1
    assert got == batches  # every batch once, in the order of the epoch without the partition
