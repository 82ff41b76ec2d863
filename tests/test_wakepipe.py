"""The wake pipe shared by the serving loop, the worker pool's dispatcher and the client's
keep-alive thread: one write per wake-up, and a ring after a drain always wakes again; an
eventfd on Linux, a pipe elsewhere."""

from __future__ import annotations

import os
import select

import pytest

from fuelline.protocol.common.wakepipe import WakePipe

KINDS = [pytest.param(True, id="eventfd"), pytest.param(False, id="pipe")]


def _readable(pipe: WakePipe) -> bool:
    return bool(select.select([pipe.fd], [], [], 0)[0])


def _read(pipe: WakePipe) -> bytes | int:
    return os.eventfd_read(pipe.fd) if pipe.eventfd else os.read(pipe.fd, 4096)


@pytest.mark.parametrize("eventfd", KINDS)
def test_rings_before_a_drain_write_once_and_a_ring_after_it_wakes_again(eventfd: bool) -> None:
    pipe = WakePipe(eventfd)
    try:
        assert pipe.eventfd == (eventfd and hasattr(os, "eventfd"))
        assert not _readable(pipe) and not pipe.rung
        for _ in range(1000):
            pipe.ring()
        assert pipe.rung and _readable(pipe)
        assert _read(pipe) == (1 if pipe.eventfd else b"x")  # (one write for a thousand rings)
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


def test_an_eventfd_wake_pipe_is_one_open_file() -> None:
    if not hasattr(os, "eventfd"):
        pytest.skip("no eventfd here (Linux only): a pipe, two files")
    before = len(os.listdir("/proc/self/fd"))
    pipe = WakePipe()
    try:
        assert len(os.listdir("/proc/self/fd")) == before + 1
    finally:
        pipe.close()
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("eventfd", KINDS)
def test_a_ring_after_close_writes_nowhere(eventfd: bool) -> None:
    pipe = WakePipe(eventfd)
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
