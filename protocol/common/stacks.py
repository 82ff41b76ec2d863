"""``kill -USR1 PID``: a fuelline process writes where each of its threads is to its stderr, and
goes on. For a process that seems stuck (a rank that reads nothing, a server that answers nobody):
what it waits on, without stopping it or attaching a debugger."""

from __future__ import annotations

import faulthandler
import signal
import sys

__all__ = ["dump_stacks_on_usr1"]


def dump_stacks_on_usr1() -> bool:
    """Install the handler (in the main thread, once a process); False where there is no SIGUSR1."""
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None:
        return False
    faulthandler.register(usr1, file=sys.stderr, all_threads=True, chain=False)
    return True
