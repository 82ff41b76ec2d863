"""CPU time of a process and its children, on Linux: what ``fuelline bench`` and the benchmarks
charge to a server and its worker processes.

A process's own time is read from its CPU clock, in nanoseconds, its exited threads included (a
session's producer thread that ended counts). /proc/PID/stat, the fallback, counts in clock ticks
(10 ms): a short run could read as 0 ms, or as 10 ms too little, which made per-window figures of
short runs meaningless.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["process_cpu_seconds", "threads_cpu_seconds"]

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_LINUX = sys.platform.startswith("linux")


def _process_clock(pid: int) -> int:
    """The clock id of a process's scheduler CPU time, as Linux encodes it (what
    ``clock_getcpuclockid`` returns, which Python does not offer): ``~pid << 3 | CPUCLOCK_SCHED``."""
    return (~pid << 3) | 2


def _own_cpu_seconds(pid: int) -> float | None:
    if _LINUX:
        try:
            return time.clock_gettime(_process_clock(pid))
        except (OSError, OverflowError):
            pass  # (no such process any more, or not a process but a thread: /proc says)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command name: state is field 3, utime and stime fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _children(pid: int) -> list[int]:
    """The live child processes of every thread of a process."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def process_cpu_seconds(pid: int, skip: frozenset[int] = frozenset()) -> float | None:
    """User + system CPU seconds of a process, all its threads and its live child processes (a
    source's worker processes) but those in ``skip``; None where there is no /proc."""
    own = _own_cpu_seconds(pid)
    if own is None:
        return None
    return own + sum(process_cpu_seconds(c, skip) or 0.0 for c in _children(pid) if c not in skip)


def threads_cpu_seconds(pid: int, children: bool = True) -> dict[tuple[int, int], tuple[str, float]]:
    """Every live thread of a process and (``children``) of its live descendants: (pid, thread id)
    -> (the name the thread carries in the operating system, its CPU seconds, to the nanosecond).
    Threads that ended are not there (``process_cpu_seconds`` counts them)."""
    out: dict[tuple[int, int], tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])  # time on a CPU; then run-queue wait and time slices
        except (OSError, ValueError, IndexError):
            continue  # (it ended meanwhile)
        out[(pid, int(tid))] = (name, ns / 1e9)
    for child in _children(pid) if children else ():
        out.update(threads_cpu_seconds(child))
    return out
