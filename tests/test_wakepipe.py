"""The wake pipe shared by the serving loop, the worker pool's dispatcher and the client's
keep-alive thread: one byte per wake-up, and a ring after a drain always wakes again."""

from __future__ import annotations

import os
import select

from fuelline.protocol.common.wakepipe import WakePipe


def _readable(pipe: WakePipe) -> bool:
    return bool(select.select([pipe.fd], [], [], 0)[0])


def test_rings_before_a_drain_write_one_byte_and_a_ring_after_it_wakes_again() -> None:
    pipe = WakePipe()
    try:
        assert not _readable(pipe) and not pipe.rung
        for _ in range(1000):
            pipe.ring()
        assert pipe.rung and _readable(pipe)
        assert os.read(pipe.fd, 4096) == b"x"  # (one byte for a thousand rings)
        pipe.ring()  # rung and not yet drained: nothing more is written
        assert not _readable(pipe)
        pipe.drain()
        assert not pipe.rung
        pipe.ring()  # the flag is down only after the drain: this ring is not lost
        assert _readable(pipe)
        pipe.drain()
        assert not _readable(pipe)
    finally:
        pipe.close()


def test_a_ring_after_close_writes_nowhere() -> None:
    pipe = WakePipe()
    fd = pipe.fd
    pipe.close()
    pipe.ring()  # (its fd numbers may belong to someone else by now)
    pipe.drain()
    pipe.close()
    reused_r, reused_w = os.pipe()  # (likely the same numbers)
    try:
        pipe.ring()
        assert not select.select([reused_r], [], [], 0)[0], f"a closed wake pipe (fd {fd}) wrote into a reused one"
    finally:
        os.close(reused_r)
        os.close(reused_w)
