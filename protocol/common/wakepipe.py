"""A self-pipe that wakes a thread sleeping in ``poll``: the serving loop, rung by producer threads
and decodes; the client's keep-alive thread, rung by credit and by closing."""

from __future__ import annotations

import os

__all__ = ["WakePipe"]


class WakePipe:
    """One byte per wake-up, not per ring: rings before the sleeper has drained the pipe write
    nothing more. The sleeper polls ``fd`` for reading, then calls ``drain`` and only then looks
    at its work, so that whatever a ring during the drain was for is seen anyway."""

    def __init__(self) -> None:
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
            os.write(self._w, b"x")
        except OSError:
            pass  # full: the sleeper is due to wake anyway

    @property
    def rung(self) -> bool:
        return self._rung

    def drain(self) -> None:
        """Empty the pipe (the sleeper's thread)."""
        try:
            while not self._closed and os.read(self.fd, 4096):
                pass
        except OSError:
            pass
        self._rung = False  # after the drain: cleared before it, a ring during it would be eaten and the flag left up

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for fd in (self.fd, self._w):
                try:
                    os.close(fd)
                except OSError:
                    pass
