"""Clients on the host dealt out in turn among the serving processes of ``--processes N``.

The kernel hands each TCP connection to one of the processes by a hash of its addresses, which
spreads connections without balancing them (in one benchmark run of 8 clients on 2 processes, two
rounds of seven split 71/29 and 81/19 %), and a synchronous job waits for the busier process. A client on the server's host
only says Hello over TCP, then moves to the Unix socket its Welcome names; so the process that
answers that Hello names the Unix socket of the next process in a turn shared by all of them,
not its own. Clients on other hosts stay where the kernel put them.

The processes share a folder that their supervisor made (mode 700): each publishes its socket
and token there as ``K.json`` once it serves, the supervisor removes a dead process's file, and
``turn`` counts the Hellos dealt, under an flock. A process whose file cannot be read is passed
over; when no other can be offered, a process offers its own socket, as a lone server does.
"""

from __future__ import annotations

import fcntl
import glob
import json
import logging
import os
from typing import Mapping

__all__ = ["LocalGroup", "process_file"]

log = logging.getLogger("fuelline.server")

TURN = "turn"


def process_file(folder: str, index: int) -> str:
    return os.path.join(folder, f"{index}.json")


class LocalGroup:
    """One serving process's view of the folder it shares with its siblings."""

    def __init__(self, folder: str, index: int) -> None:
        self.folder = folder
        self.index = index

    def publish(self, local: Mapping[str, str]) -> None:
        """Make this process's Unix socket (and its token) one that siblings may offer."""
        path = process_file(self.folder, self.index)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"endpoint": local["endpoint"], "token": local["token"]}, f)
        os.replace(tmp, path)  # (readers never see half a file)

    def _next_turn(self) -> int:
        fd = os.open(os.path.join(self.folder, TURN), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            text = os.pread(fd, 32, 0).decode().strip()
            turn = int(text) if text.isdigit() else 0
            os.pwrite(fd, f"{turn + 1:<20d}".encode(), 0)
            return turn
        finally:
            os.close(fd)  # (and the lock with it)

    def offer(self, own: Mapping[str, str]) -> Mapping[str, str]:
        """The Unix socket to offer a client that said Hello over TCP: the next process's in turn."""
        try:
            paths = sorted(glob.glob(os.path.join(glob.escape(self.folder), "*.json")))
            if not paths:
                return own
            start = self._next_turn()
            for k in range(len(paths)):
                try:
                    with open(paths[(start + k) % len(paths)]) as f:
                        entry = json.load(f)
                    return {"endpoint": str(entry["endpoint"]), "token": str(entry["token"])}
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # (gone with its process, or being replaced): the next one
        except OSError as exc:
            log.warning("cannot deal a client to a serving process through %s (%s): offering this one's socket",
                        self.folder, exc)
        return own
