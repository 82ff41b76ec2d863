"""A session's production has one path, whoever steps it: the serving loop (a ``cooperative``
source) or a producer thread (any other). The thread is a driver around the same steps: it waits
for room in the send queue before it prepares the next batch, and for the futures of a
``Waiting`` where the source yields one, and rings the loop for each item it queued."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from fuelline.protocol import Hello, decode
from fuelline.server.serving.session import Session
from fuelline.server.sources.contract import Batches, BatchSource, Steps, Waiting

from support.processes import wait_until

TIMEOUT = 10.0
HWM = 3


class Counted(BatchSource):
    """A source that is not cooperative: it counts the batches pulled from it; ``waits`` makes
    its steps yield a ``Waiting`` before each batch, done by a timer thread."""

    def __init__(self, batches: int, waits: bool = False) -> None:
        super().__init__()
        self.pulled = 0
        self.batches = batches
        self.waits = waits
        self.timers: list[threading.Timer] = []

    @property
    def sources(self) -> tuple[str, ...]:
        return ("x",)

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train",)

    def schema(self) -> Mapping[str, Mapping[str, Any]]:
        return {"x": {"dtype": "int64", "shape": [2]}}

    def info(self, split: str) -> Mapping[str, Any]:
        return {}

    def fingerprint(self, split: str) -> dict[str, str]:
        return {"source": "counted"}

    def batches_per_epoch(self, split: str, rank: int, world_size: int) -> int | None:
        return self.batches

    def _batch(self, seq: int) -> dict[str, np.ndarray]:
        self.pulled += 1
        return {"x": np.full((4, 2), seq, dtype=np.int64)}

    def iter_batches(self, split: str, epoch: int, rank: int, world_size: int, start: int,
                     sources: tuple[str, ...], on_loss: Callable[[str], None] | None = None,
                     history: Sequence[tuple[int, ...]] = ()) -> Batches:
        for seq in range(start, self.batches):
            yield self._batch(seq)

    def iter_steps(self, split: str, epoch: int, rank: int, world_size: int, start: int,
                   sources: tuple[str, ...], on_loss: Callable[[str], None] | None = None,
                   history: Sequence[tuple[int, ...]] = ()) -> Steps:
        if not self.waits:
            yield from self.iter_batches(split, epoch, rank, world_size, start, sources, on_loss, history)
            return
        for seq in range(start, self.batches):
            future: Future = Future()
            timer = threading.Timer(0.001, future.set_result, (None,))
            self.timers.append(timer)
            timer.start()
            yield Waiting((future,))
            assert future.done(), "asked again before its decode was done"
            yield self._batch(seq)

    def close(self) -> None:
        for timer in self.timers:
            timer.cancel()


def _session(source: BatchSource, credit: int) -> tuple[Session, threading.Event]:
    rung = threading.Event()
    hello = Hello(client_id="c", credit=credit, heartbeat=1.0)
    session = Session(b"r", hello, source, ("x",), HWM, True, rung.set, "s")
    return session, rung


def _take_all(session: Session, rung: threading.Event, items: int) -> list[tuple[str, Any]]:
    """Items as a loop takes them: whenever rung, with credit for every batch taken."""
    out: list[tuple[str, Any]] = []
    wait_until(lambda: _drain(session, rung, out) >= items, TIMEOUT, f"{items} items from the session")
    return out


def _drain(session: Session, rung: threading.Event, out: list[tuple[str, Any]]) -> int:
    rung.wait(0.05)
    rung.clear()
    for kind, frames, _ in session.take_sendable():
        out.append((kind, decode(frames)))
        if kind == "batch":
            session.grant(1)
    return len(out)


def test_a_producer_thread_prepares_no_batch_beyond_the_send_queue_it_waits_for() -> None:
    # A client that grants one batch and takes none: the queue fills to hwm, and the producer
    # waits for room without a batch in hand (it has pulled hwm + the one sent, no more).
    source = Counted(batches=50)
    session, rung = _session(source, credit=1)
    assert not session.inline
    session.start()
    try:
        wait_until(lambda: session.sent_batches + session.queued >= HWM, TIMEOUT, "the first batches")
        assert len(session.take_sendable()) == 1
        wait_until(lambda: session.queued == HWM and session._producer_waiting, TIMEOUT, "the producer waits for room")
        assert source.pulled == HWM + 1
    finally:
        session.stop()
        session.join(TIMEOUT)
    assert not session.producer_alive


def test_a_producer_thread_steps_the_same_production_and_waits_for_its_decodes() -> None:
    # Not cooperative, yet yielding Waiting: the thread waits for each decode, and every batch
    # and the end of the epoch come in order.
    source = Counted(batches=7, waits=True)
    session, rung = _session(source, credit=HWM)
    session.start()
    try:
        items = _take_all(session, rung, 8)[:8]  # (then the next epoch's)
    finally:
        session.stop()
        session.join(TIMEOUT)
    assert [kind for kind, _ in items] == ["batch"] * 7 + ["end"]
    assert [int(msg.arrays["x"][0, 0]) for kind, msg in items if kind == "batch"] == list(range(7))
    assert (items[-1][1].epoch, items[-1][1].batches) == (0, 7)
    assert len(source.timers) >= 7  # (each batch came through its steps, after its decode)
    assert not session.producer_alive


def test_the_loop_steps_a_cooperative_source_with_the_same_production() -> None:
    source = Counted(batches=5, waits=True)
    source.cooperative = True
    session, rung = _session(source, credit=HWM)
    session.start()
    assert session.inline and not session.producer_alive
    out: list[tuple[str, Any]] = []

    def step() -> int:
        session.advance(until=float("inf"))
        return _drain(session, rung, out)

    try:
        wait_until(lambda: step() >= 6, TIMEOUT, "6 items from the loop's steps")
    finally:
        session.stop()
    out = out[:6]  # (then the next epoch's)
    assert [kind for kind, _ in out] == ["batch"] * 5 + ["end"]
    assert [int(msg.arrays["x"][0, 0]) for kind, msg in out if kind == "batch"] == list(range(5))
