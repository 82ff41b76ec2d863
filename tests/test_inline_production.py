"""A unit source's batches are prepared by the serving loop itself, between requests: no thread
per client, and a decode that takes long holds up only the client whose batch needs it. The
loop never waits on a decode: where a batch's units are still being decoded, the source says so
(``iter_steps`` yields a ``Waiting``) and the loop serves the others until they are done."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import Batch, Credit, EndOfEpoch, Heartbeat, Hello, Welcome
from fuelline.server.sources.contract import Waiting

from support.raw_client import RawClient
from support.workers import FakeUnits

TIMEOUT = 30.0
TESTS = Path(__file__).parent


class GatedUnits(FakeUnits):
    """Decoding any unit waits until ``gate`` is set."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.gate = threading.Event()

    def decode_unit(self, split, u, columns):
        assert self.gate.wait(TIMEOUT), "the test never opened the gate"
        return super().decode_unit(split, u, columns)


def _ids(batches) -> list[int]:
    return [int(i) for b in batches for i in b["sample_id"]]


def _step(steps, end: object) -> object:
    """The next step, which must come at once: a step that waited on a decode would hold its
    caller (a serving loop) until the decode is done."""
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(next(steps, end)), daemon=True)
    thread.start()
    thread.join(5.0)
    assert not thread.is_alive(), "a step waited for a decode"
    return out[0]


def test_iter_steps_says_what_it_waits_for_instead_of_waiting_and_yields_what_iter_batches_does() -> None:
    options = dict(units=8, rows=10, batch_size=7, shuffle_block=2, decoded_cache_mb=0)
    source = GatedUnits(**options)
    try:
        # The epoch's plan made first: its thread makes a block once a reader asks for it, and
        # the steps would wait for that too (tests/test_epoch_plan.py); here, only for decodes.
        assert len(source._plan("train", 1).order) == 80
        steps = source.iter_steps("train", 1, 0, 1, 0, ("sample_id",))
        end = object()
        first = _step(steps, end)
        assert isinstance(first, Waiting) and first.futures
        again = _step(steps, end)  # asked again with its decodes still undone: it waits again
        assert isinstance(again, Waiting) and set(again.futures) == set(first.futures)
        assert not any(f.done() for f in again.futures)
        source.gate.set()
        got, waits = [], 1
        while (item := _step(steps, end)) is not end:
            if isinstance(item, Waiting):
                waits += 1
                for future in item.futures:
                    future.result(TIMEOUT)
            else:
                got.append(item)
    finally:
        source.gate.set()
        source.close()
    plain = FakeUnits(**options)
    try:
        want = _ids(plain.iter_batches("train", 1, 0, 1, 0, ("sample_id",)))
    finally:
        plain.close()
    assert _ids(got) == want and len(want) == 80
    print(f"\n{waits} waits over {len(got)} batches")


def test_iter_batches_of_a_unit_source_never_yields_a_waiting() -> None:
    source = GatedUnits(units=4, rows=10, batch_size=7, shuffle_block=2)
    source.gate.set()
    try:
        batches = list(source.iter_batches("train", 0, 0, 1, 0, ("sample_id",)))
    finally:
        source.close()
    assert batches and all(isinstance(b, dict) for b in batches)
    assert sorted(_ids(batches)) == sorted(u * 1000 + r for u in range(4) for r in range(10))


SCRIPT = """
import os, sys, time
sys.path.insert(0, {tests!r})
os.cpu_count = lambda: 4  # (the read-ahead threads number min(4, cores): the gated decode holds one)
from support.workers import FakeUnits
from fuelline.server.serving.server import Server
from fuelline.server.serving.start import serve_until_signalled


class TwoSplits(FakeUnits):
    # Split "slow": decoding its unit 5 waits until the file GATE exists, having made STARTED.
    def __init__(self, **options):
        super().__init__(**options)
        self._splits = {{"fast": None, "slow": None}}

    def decode_unit(self, split, u, columns):
        if split == "slow" and u == 5:
            open({started!r}, "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists({gate!r}) and time.monotonic() < deadline:
                time.sleep(0.005)
        return super().decode_unit(split, u, columns)


source = TwoSplits(units=8, rows=10, batch_size=7, shuffle_block=2)
serve_until_signalled(Server(source, port=0, hwm=2, heartbeat=0.2, local_ipc=False))
"""


@pytest.mark.timeout(120)
def test_a_client_whose_batch_waits_on_a_decode_holds_up_no_other(tmp_path: Path, start_script, zmq_context) -> None:
    started, gate = tmp_path / "started", tmp_path / "gate"
    server = start_script(SCRIPT.format(tests=str(TESTS), started=str(started), gate=str(gate)))
    slow = RawClient(zmq_context, server.endpoint)
    slow.send(Hello("slow-reader", split="slow", credit=2, heartbeat=60.0))
    assert isinstance(slow.recv(TIMEOUT), Welcome)
    ids: list[int] = []
    deadline = time.monotonic() + TIMEOUT
    while not started.exists():  # read, returning credit, until the gated decode has begun
        assert time.monotonic() < deadline, "the slow split's unit 5 was never decoded"
        if slow.sock.poll(50):
            msg = slow.recv(TIMEOUT)
            if isinstance(msg, Batch):
                ids += [int(i) for i in msg.arrays["sample_id"]]
                slow.send(Credit(1))
    try:
        # Meanwhile: another client reads a whole epoch, and a new one is welcomed.
        with ServerDataStream(("sample_id",), endpoints=[server.endpoint], split="fast", timeout=TIMEOUT,
                              receive_timeout=TIMEOUT) as fast:
            fast_ids = _ids(fast.get_epoch_iterator(as_dict=True))
        assert sorted(fast_ids) == sorted(u * 1000 + r for u in range(8) for r in range(10))
        newcomer = RawClient(zmq_context, server.endpoint)
        newcomer.send(Hello("newcomer", split="fast", credit=0))
        assert isinstance(newcomer.recv(TIMEOUT), Welcome)
        # ...and the slow client hears heartbeats: the loop is not stuck with its decode.
        heard = slow.recv_for(1.0)
        assert any(isinstance(m, Heartbeat) for m in heard), heard
        for msg in heard:
            if isinstance(msg, Batch):  # (prepared before the gated unit was needed)
                ids += [int(i) for i in msg.arrays["sample_id"]]
                slow.send(Credit(1))
    finally:
        gate.touch()
    # Once the decode is done, the slow client gets the rest of its epoch.
    while True:
        msg = slow.recv(TIMEOUT)
        if isinstance(msg, EndOfEpoch):
            break
        if isinstance(msg, Batch):
            ids += [int(i) for i in msg.arrays["sample_id"]]
            slow.send(Credit(1))
    assert sorted(ids) == sorted(u * 1000 + r for u in range(8) for r in range(10))


def test_clients_of_a_unit_source_cost_the_serving_process_no_thread_each(sample_dataset: Path, start_serve) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("counts threads in Linux /proc")
    server = start_serve(sample_dataset, "--batch-size", "100")
    streams = [ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT, hwm=2) for _ in range(8)]
    try:
        first = streams[0].get_epoch_iterator()
        next(first)  # the read-ahead threads exist from here on
        with_one = len(os.listdir(f"/proc/{server.proc.pid}/task"))
        iterators = [s.get_epoch_iterator() for s in streams[1:]]
        for it in iterators:
            next(it)
        with_eight = len(os.listdir(f"/proc/{server.proc.pid}/task"))
    finally:
        for s in streams:
            s.close()
    # (The read-ahead pool may grow by a thread or three as more decodes overlap.)
    assert with_eight - with_one <= 3, (with_one, with_eight)
