"""A self-pipe that wakes a thread sleeping in ``poll``: the serving loop, rung by producer threads
and decodes; the client's keep-alive thread, rung by credit and by closing.

On Linux it is one ``eventfd`` (one file, where a pipe holds two: a reader of a hundred servers
keeps one such per server); elsewhere a pipe."""

from __future__ import annotations

import os

__all__ = ["WakePipe"]


class WakePipe:
    """One write per wake-up, not per ring: rings before the sleeper has drained it write
    nothing more. The sleeper polls ``fd`` for reading, then calls ``drain`` and only then looks
    at its work, so that whatever a ring during the drain was for is seen anyway."""

    def __init__(self, eventfd: bool = True) -> None:
        self.eventfd = eventfd and hasattr(os, "eventfd")
        if self.eventfd:
            self.fd = self._w = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:
            self.fd, self._w = os.pipe()
            os.set_blocking(self.fd, False)
            os.set_blocking(self._w, False)
        self._rung = False
        self._closed = False

    def ring(self) -> None:
        """Wake the sleeper (from any thread)."""
        if self._closed or self._rung:
            return  # (closed: its fd numbers may belong to someone else by now)
        self._rung = True
        try:
            if self.eventfd:
                os.eventfd_write(self._w, 1)
            else:
                os.write(self._w, b"x")
        except OSError:
            pass  # full: the sleeper is due to wake anyway

    @property
    def rung(self) -> bool:
        return self._rung

    def drain(self) -> None:
        """Empty it (the sleeper's thread)."""
        try:
            if self.eventfd:
                if not self._closed:
                    os.eventfd_read(self.fd)  # (the count, reset to 0; BlockingIOError at 0)
            else:
                while not self._closed and os.read(self.fd, 4096):
                    pass
        except OSError:
            pass
        self._rung = False  # after the drain: cleared before it, a ring during it would be eaten and the flag left up

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for fd in {self.fd, self._w}:
                try:
                    os.close(fd)
                except OSError:
                    pass
