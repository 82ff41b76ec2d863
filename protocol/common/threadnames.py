"""The name a thread carries in the operating system: what ``top -H``, ``ps -L``, py-spy, perf and
/proc/PID/task/TID/comm show. Python 3.11 gives a ``threading.Thread`` its name in Python only,
so every thread of a server showed as ``python``; its busy threads name themselves by role
(``fl-produce``, ``fl-read``, ...), so that an operator, and the benchmarks, can tell where a
server's CPU goes.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["name_this_thread", "MAX_NAME_BYTES"]

MAX_NAME_BYTES = 15  # Linux keeps 16 bytes, the terminating NUL included
_PR_SET_NAME = 15

_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # (a libc without prctl: names stay Python's own)
        _prctl = None


def name_this_thread(name: str) -> None:
    """Name the calling thread in the operating system (its first 15 bytes, on Linux); elsewhere,
    or where that fails, nothing changes: a name is a help to whoever looks, never needed."""
    if _prctl is None:
        return
    raw = name.encode("utf-8", "replace")[:MAX_NAME_BYTES]
    _prctl(_PR_SET_NAME, ctypes.c_char_p(raw), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
