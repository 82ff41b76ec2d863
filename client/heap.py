"""The C heap under received batches: keep freed receive buffers for the next ones (glibc).

libzmq receives each message into a buffer it allocates with ``malloc``, and a batch's arrays are
views of those buffers until the user drops them (nothing is copied on the way in). glibc gives the
memory freed at the top of a heap back to the kernel once more than its trim threshold is free
there (by default twice the largest block freed so far: about two batches), so a client, which
holds up to ``hwm`` batches and frees them in bursts, keeps returning pages that the next batches
fault in again, zero-filled by the kernel: 65 to 294 page faults per 3 MB batch over TCP (bare
pyzmq, which holds none: 9 to 62). Kept, a reader read 1.26 to 1.31 × the GB/s at 0.69 to 0.71 ×
its CPU a batch, for 5 % more peak memory (``python -m benchmarks heap``).

``hold`` raises the trim threshold to twice what the process's connections may hold in flight
and fixes the mmap threshold at 32 MB, where glibc's own adjustment of it stops (setting one
threshold turns off glibc's adjustment of both): freed buffers stay mapped for the next batches,
and the process keeps at most that much free memory it would soon use again. Thresholds are only
raised, never lowered. A batch over 32 MB is still mapped afresh for each message.

It does nothing off glibc, where the user has chosen (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_MAX_``, or ``glibc.malloc.`` in
``GLIBC_TUNABLES``), or where ``FUELLINE_HEAP=system`` asks for glibc's defaults.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

__all__ = ["MMAP_THRESHOLD", "SMALLEST", "TRIM_CEILING", "TRIM_FLOOR", "hold", "held", "left_alone", "release",
           "why_left_alone"]

log = logging.getLogger("fuelline.client")

# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # where glibc's own adjustment of it stops on 64-bit (larger blocks: mapped afresh)
TRIM_FLOOR = 64 << 20  # glibc's own ceiling for its adjusted trim threshold
TRIM_CEILING = 1 << 30  # the most free memory the process keeps for batches to come
SMALLEST = 128 << 10  # glibc's first mmap threshold: a connection's smaller messages never size the heap

USER_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_lock = threading.Lock()
_held = 0  # the trim threshold set; 0 while none is
_windows: dict[object, int] = {}  # what each connection may hold in flight, in bytes
_mallopt = None  # the C function, once found
_why_not: str | None = None  # why the heap is left alone, once known


def left_alone(environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """Why this process's heap is left as it is (None if fuelline may tune it)."""
    choice = environ.get("FUELLINE_HEAP", "")
    if choice == "system":
        return "FUELLINE_HEAP=system"
    if choice:
        log.warning("FUELLINE_HEAP=%r is not understood: 'system' leaves the heap to glibc's defaults; "
                    "a reader keeps its freed receive buffers meanwhile", choice)
    for name in USER_VARIABLES:
        if name in environ:
            return f"{name} is set"
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    return None


def _find_mallopt() -> str | None:
    global _mallopt
    why = left_alone()
    if why is not None:
        return why
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (only glibc's heap behaves as described above)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return "not glibc"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _mallopt = mallopt
    return None


def hold(key: object, nbytes: int) -> int:
    """Keep freed receive buffers mapped while the connection ``key`` may hold ``nbytes`` of them
    in flight (its credit times its largest message), beside what the others may; returns the trim
    threshold now set (0 where the heap is left alone)."""
    global _held, _why_not
    with _lock:
        _windows[key] = nbytes
        want = min(TRIM_CEILING, max(TRIM_FLOOR, 2 * sum(_windows.values())))
        if want <= _held:
            return _held
        if _why_not is None:
            _why_not = _find_mallopt() or ""
        if _why_not:
            return 0
        assert _mallopt is not None
        if not _held and not _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
            _why_not = "mallopt refused an mmap threshold of 32 MB"
            return 0
        if _mallopt(_M_TRIM_THRESHOLD, want):
            log.debug("received batches: glibc's trim threshold raised to %d bytes", want)
            _held = want
        return _held


def release(key: object) -> None:
    """The connection ``key`` holds nothing any more (thresholds set stay as they are)."""
    with _lock:
        _windows.pop(key, None)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) keeps the thresholds its parent set, but none of its
    parent's connections, and no lock another thread of the parent held as it forked."""
    global _lock
    _lock = threading.Lock()
    _windows.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def held() -> int:
    """The trim threshold set (0 while none is, or where the heap is left alone)."""
    return _held


def why_left_alone() -> str | None:
    """Why the heap was left alone, once a connection asked (None while it is not)."""
    return _why_not or None
