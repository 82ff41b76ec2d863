"""``kill -USR1 PID``: a fuelline process writes where each of its threads is to its stderr, and
goes on. For a process that seems stuck (a rank that reads nothing, a server that answers nobody):
what it waits on, without stopping it or attaching a debugger."""

from __future__ import annotations

import faulthandler
import signal
import sys

__all__ = ["dump_stacks_on_usr1"]


def dump_stacks_on_usr1() -> bool:
    """Install the handler; False where there is no SIGUSR1, or no stderr with a file descriptor
    to write to (where ``sys.stderr`` is replaced by one without, the process's own is used)."""
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None:
        return False
    for stream in (sys.stderr, sys.__stderr__):
        try:
            fd = stream.fileno()  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):  # (None, or a StringIO: io.UnsupportedOperation)
            continue
        faulthandler.register(usr1, file=fd, all_threads=True, chain=False)
        return True
    return False
