"""File descriptors: how many this process may open, room made for more, and the error when none
is left.

Every connection holds some: a server one per client over TCP and two per client on its Unix
socket; a client about five per server it reads (its ZeroMQ socket, the socket's mailbox, the
TCP connection and a wake-up pipe). The usual soft limit of 1,024 runs out at about a thousand
clients of one server, or two hundred servers of one reader. Past it, libzmq cannot accept a
connection and retries at once, for ever: the server's I/O thread spins a whole core, and the
clients it never accepted hear nothing. So a server or a reader first raises its soft limit as
far as its hard limit allows for what it may hold (``make_room``), a server warns when even that
is short, and running out is an error that says so (``exhausted``).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

try:
    import resource
except ImportError:  # (not on Windows, which has no such limit to raise)
    resource = None  # type: ignore[assignment]

__all__ = ["Room", "limits", "open_count", "make_room", "exhausted", "EXHAUSTED", "HOW_TO_RAISE"]

EXHAUSTED = (errno.EMFILE, errno.ENFILE)  # this process's limit, the system's
HOW_TO_RAISE = "raise it with `ulimit -n` (LimitNOFILE= in a systemd unit, --ulimit nofile= for docker)"


@dataclass(frozen=True)
class Room:
    """What ``make_room`` found and did.

    Attributes:
        needed: descriptors asked for, beyond those open.
        open: descriptors open when asked (None where they cannot be counted).
        before, after: the soft limit before and after (equal when nothing was raised).
        hard: the hard limit, which only a privileged process may raise.
    """

    needed: int
    open: int | None
    before: int
    after: int
    hard: int

    @property
    def raised(self) -> bool:
        return self.after > self.before

    @property
    def short(self) -> bool:
        """Whether ``needed`` more do not fit under the soft limit, even as raised."""
        return (self.open or 0) + self.needed > self.after


def limits() -> tuple[int, int] | None:
    """The soft and hard limits on open files (``RLIM_INFINITY`` as a large number); None where
    the platform has none."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    return (2**31 - 1 if soft == infinite else soft), (2**31 - 1 if hard == infinite else hard)


def open_count() -> int | None:
    """Descriptors this process has open, where the system lists them (Linux, macOS); the soft
    limit when not one is left to list them with."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return max(0, len(os.listdir(folder)) - 1)  # (less the one listing it)
        except OSError as exc:
            if exc.errno == errno.EMFILE and (now := limits()) is not None:
                return now[0]
            continue
    return None


def make_room(needed: int) -> Room | None:
    """Raise the soft limit on open files so that ``needed`` more than are open now fit, as far as
    the hard limit allows; never lower it. None where the platform has no such limit."""
    now = limits()
    if now is None:
        return None
    soft, hard = now
    count = open_count()
    want = (count or 0) + needed
    after = soft
    if want > soft and soft < hard:
        after = min(hard, want)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (after, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        except (ValueError, OSError):
            after = soft
    return Room(needed, count, soft, after, hard)


def exhausted(what: str, exc: BaseException, per: str = "") -> OSError:
    """The error for ``what`` failing for want of a descriptor (``exc``, whose errno is one of
    ``EXHAUSTED``): what is open, the limits, and how to raise them."""
    code = getattr(exc, "errno", None) or errno.EMFILE
    now = limits()
    count = open_count()
    state = (f"{count} open, " if count is not None else "") + (
        f"the limit is {now[0]} (hard limit {now[1]})" if now is not None else "the system's limit reached")
    if code == errno.ENFILE:
        state = "the whole system's table of open files is full"
    return OSError(code, f"{what}: out of file descriptors ({state}){'; ' + per if per else ''}; {HOW_TO_RAISE}")
