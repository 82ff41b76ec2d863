"""Peers for the admission tests: a raw DEALER speaking the protocol by hand, an honest reader
streaming an epoch beside the attack, and a sampler of a process's thread count."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import numpy as np
import zmq

from fuelline.client import ServerDataStream
from fuelline.protocol import Bye, Heartbeat, Welcome, decode, encode

__all__ = [
    "REPLY_WAIT", "ROWS", "WIDE_BATCH", "WIDE_ROWS", "HonestReader", "Peer", "ThreadPeak", "hello_until_welcomed",
    "start_honest", "thread_count", "welcome_all",
]

REPLY_WAIT = 10.0  # seconds a peer waits for an answer from a busy server on 2 shared cores
ROWS = 8000  # train rows of the sample_dataset fixture: sample_id 0..7999
WIDE_ROWS = 6400  # train rows of the wide dataset: sample_id 0..6399
WIDE_BATCH = 640  # rows per batch: 10 batches of 655 KB (256 float32 features a row)


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


class ThreadPeak(threading.Thread):
    """The most threads a process had, sampled every 20 ms (a burst between two checks shows too)."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="thread-peak", daemon=True)
        self.pid = pid
        self.baseline = self.peak = thread_count(pid)
        self._stop_event = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._stop_event.wait(0.02):
            try:
                self.peak = max(self.peak, thread_count(self.pid))
            except OSError:
                return

    def stop(self) -> int:
        self._stop_event.set()
        self.join(5.0)
        return self.peak


class Peer:
    """A raw DEALER speaking the protocol by hand; ``source`` binds its end to another loopback
    address (127.0.0.2...), so the server sees another peer."""

    def __init__(self, ctx: zmq.Context, port: int, source: str | None = None, rcvhwm: int = 1000) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.connect(f"tcp://{source}:0;127.0.0.1:{port}" if source else f"tcp://127.0.0.1:{port}")

    def send(self, msg: Any) -> None:
        self.sock.send_multipart(encode(msg) if not isinstance(msg, list) else msg, copy=False)

    def recv(self, timeout: float = REPLY_WAIT) -> Any:
        """The next message, decoded; None if nothing came within ``timeout``."""
        if not self.sock.poll(timeout * 1000):
            return None
        return decode(self.sock.recv_multipart(copy=False))

    def answer(self, timeout: float = REPLY_WAIT) -> Any:
        """The next message that is not a Heartbeat."""
        deadline = time.monotonic() + timeout
        while (msg := self.recv(max(0.0, deadline - time.monotonic()))) is not None and isinstance(msg, Heartbeat):
            pass
        return msg

    def close(self) -> None:
        self.sock.close(linger=0)


class HonestReader(threading.Thread):
    """Reads one epoch of ``sample_id`` in the background, parking after batch ``park_at`` until
    the attack is over (so the attack meets a session with batches in flight). It records its
    MB/s and the longest gap between two batches; timeouts make a hung server fail the test."""

    def __init__(self, port: int, attack_over: threading.Event, park_at: int = 3, hwm: int = 4) -> None:
        super().__init__(name="honest-reader", daemon=True)
        self.port, self.attack_over, self.park_at, self.hwm = port, attack_over, park_at, hwm
        self.streaming = threading.Event()
        self.ids: list[np.ndarray] = []
        self.error: BaseException | None = None
        self.max_gap = 0.0

    def run(self) -> None:
        try:
            with ServerDataStream(("sample_id",), host="127.0.0.1", port=self.port, hwm=self.hwm, timeout=20.0,
                                  receive_timeout=20.0) as stream:
                last = None
                for (ids,) in stream.get_epoch_iterator():
                    now = time.monotonic()
                    if last is not None and len(self.ids) != self.park_at:
                        self.max_gap = max(self.max_gap, now - last)
                    self.ids.append(ids)
                    self.streaming.set()
                    if len(self.ids) == self.park_at:
                        self.attack_over.wait(60.0)  # the keep-alive thread heartbeats meanwhile
                    last = time.monotonic()
        except BaseException as exc:  # handed to the test's thread, which asserts on it
            self.error = exc
        finally:
            self.streaming.set()

    def check_epoch(self, rows: int) -> None:
        self.join(30.0)
        assert not self.is_alive(), "the honest client did not finish its epoch within 30s of the attack"
        assert self.error is None, f"the honest client failed: {self.error!r}"
        ids = np.sort(np.concatenate(self.ids))
        assert np.array_equal(ids, np.arange(rows)), f"the honest client got {len(ids)} rows, {len(np.unique(ids))} distinct"


def start_honest(port: int, park_at: int = 3, hwm: int = 4) -> tuple[HonestReader, threading.Event]:
    attack_over = threading.Event()
    honest = HonestReader(port, attack_over, park_at, hwm)
    honest.start()
    assert honest.streaming.wait(20.0) and honest.error is None, f"no first batch: {honest.error!r}"
    return honest, attack_over


def welcome_all(peers: list[Peer], hello: Any) -> list[Any]:
    for i, peer in enumerate(peers):
        peer.send(hello(i))
    return [peer.answer() for peer in peers]


def hello_until_welcomed(ctx: zmq.Context, port: int, hello: Any, meanwhile: Callable[[], None], timeout: float,
                         source: str | None = None, leave: bool = False) -> tuple[list[Any], Peer | None]:
    """A newcomer on a full server: ``hello`` from a fresh connection (from ``source``), again
    until it is welcomed or ``timeout`` passes; ``meanwhile`` runs before each try (the sessions
    holding the places heartbeat, or read and grant, so that only credit tells them apart).
    ``leave``: a Bye follows each Hello at once, so that a welcomed newcomer leaves its place
    free. Returns every answer, and the welcomed connection (None if none was), still open."""
    answers: list[Any] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        meanwhile()
        peer = Peer(ctx, port, source=source)
        peer.send(hello)
        if leave:
            peer.send(Bye("leaving at once"))
        answers.append(peer.answer())
        if isinstance(answers[-1], Welcome):
            return answers, peer
        peer.close()
        time.sleep(0.05)  # pacing the retries (the deadline above bounds the wait)
    return answers, None
