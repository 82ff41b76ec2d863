"""Which folders are in memory: /dev/shm where this user may use it, and whether a path lies on a
memory file system. Worker hand-off files and the server's socket folder (with its shared-memory
slabs) both want such a folder."""

from __future__ import annotations

import os

__all__ = ["SHM", "writable_shm", "on_memory_fs"]

SHM = "/dev/shm"
MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})


def writable_shm() -> bool:
    """Whether /dev/shm exists and this user may create files there."""
    return os.path.isdir(SHM) and os.access(SHM, os.W_OK | os.X_OK)


def on_memory_fs(path: str) -> bool:
    """Whether ``path`` lies on a file system in memory (tmpfs, ramfs), by /proc/self/mountinfo:
    the mount point that is the longest prefix of its real path decides. False without /proc."""
    real = os.path.realpath(path)
    best, fstype = -1, ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if " - " not in line or len(fields) < 5:
                    continue
                point = fields[4].replace("\\040", " ")
                after = line.split(" - ", 1)[1].split()
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if after and inside and len(point) >= best:
                    best, fstype = len(point), after[0]
    except OSError:
        return False
    return fstype in MEMORY_FILE_SYSTEMS
