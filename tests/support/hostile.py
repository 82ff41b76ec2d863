"""Hostile peers' tools: a raw DEALER that sends whatever frames it is given, an honest reader
streaming an epoch beside the attack, and what the server's log says of its sessions."""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

import msgpack
import numpy as np
import zmq

from fuelline.client import ServerDataStream
from fuelline.protocol import Batch, Heartbeat, Hello, Welcome, decode, encode

__all__ = [
    "DROPPED", "REPLY_WAIT", "ROWS", "HonestReader", "Peer", "assert_serves_a_newcomer", "frames_of",
    "thread_count", "with_header",
]

ROWS = 8000  # train rows of the sample_dataset fixture, sample_id 0..7999
REPLY_WAIT = 10.0  # seconds a hostile peer waits for its answer from a busy server on 2 cores


def thread_count(pid: int) -> int:
    """Threads of a process; each server session has one producer thread while it lives."""
    return len(os.listdir(f"/proc/{pid}/task"))


def frames_of(msg: Any) -> list[bytes]:
    return [bytes(memoryview(f)) for f in encode(msg)]


def with_header(frames: list[bytes], **changes: Any) -> list[bytes]:
    """A valid message with header fields changed (``None`` as a value removes the field)."""
    header = msgpack.unpackb(frames[0], raw=False)
    for key, value in changes.items():
        if value is None:
            header.pop(key, None)
        else:
            header[key] = value
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


class Peer:
    """A raw DEALER that sends whatever frames it is given and reads what comes back."""

    def __init__(self, ctx: zmq.Context, endpoint: str, rcvhwm: int = 1000) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.connect(f"tcp://{endpoint}")

    def send(self, frames: list[Any]) -> None:
        self.sock.send_multipart(frames)

    def reply(self, timeout: float = REPLY_WAIT) -> Any:
        """The next message, decoded; None if nothing came within ``timeout``."""
        if not self.sock.poll(timeout * 1000):
            return None
        return decode(self.sock.recv_multipart(copy=False))

    def close(self) -> None:
        self.sock.close(linger=0)


class HonestReader(threading.Thread):
    """Reads one epoch of ``sample_id`` through ServerDataStream in the background.

    It reads slowly while the attack runs and parks mid-epoch (batch ``park_at``) until the attack
    is over, so the attack meets a session with batches in flight, not an idle server. receive_timeout
    and timeout are set, so a server that hangs fails the test instead of hanging it.
    """

    def __init__(self, endpoint: str, attack_over: threading.Event, park_at: int = 100) -> None:
        super().__init__(name="honest-reader", daemon=True)
        self.endpoint = endpoint
        self.attack_over = attack_over
        self.park_at = park_at
        self.started_streaming = threading.Event()
        self.ids: list[np.ndarray] = []
        self.batches = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with ServerDataStream(
                ("sample_id",), endpoints=[self.endpoint], hwm=4, timeout=20.0, receive_timeout=20.0
            ) as stream:
                for (ids,) in stream.get_epoch_iterator():
                    self.ids.append(ids)
                    self.batches += 1
                    self.started_streaming.set()
                    if self.batches == self.park_at:
                        self.attack_over.wait(60.0)  # the keep-alive thread heartbeats meanwhile
                    elif not self.attack_over.is_set():
                        time.sleep(0.01)
        except BaseException as exc:  # handed to the test's thread, which asserts on it
            self.error = exc
        finally:
            self.started_streaming.set()

    def check_complete_epoch(self) -> None:
        self.join(30.0)
        assert not self.is_alive(), "the honest client did not finish its epoch in 30s after the attack"
        assert self.error is None, f"the honest client failed: {self.error!r}"
        ids = np.concatenate(self.ids)
        assert len(ids) == ROWS and np.array_equal(np.sort(ids), np.arange(ROWS)), (
            f"the honest client got {len(ids)} rows, {len(np.unique(ids))} distinct"
        )


def assert_serves_a_newcomer(ctx: zmq.Context, endpoint: str) -> None:
    """The serving loop is alive: a fresh connection's Hello is welcomed and fed."""
    peer = Peer(ctx, endpoint)
    try:
        peer.send(frames_of(Hello("newcomer", credit=1, heartbeat=5.0)))
        welcome = peer.reply()
        assert isinstance(welcome, Welcome), f"a newcomer's Hello got {welcome!r}"
        batch = peer.reply()
        while isinstance(batch, Heartbeat):  # a server still busy with the attack's leftovers
            batch = peer.reply()
        assert isinstance(batch, Batch) and batch.seq == 0, f"a welcomed newcomer got {batch!r}"
    finally:
        peer.close()


DROPPED = re.compile(r"client (\S+) dropped: (disconnected|silent|not reading|said bye|replaced)")


