"""Decoded arrays from a worker process to the serving process through a shared-memory file.

A worker writes a unit's arrays one after another (each aligned to ``ALIGN`` bytes) into one file
in /dev/shm (a RAM-backed filesystem; the temporary directory where there is none; or
``$FUELLINE_HANDOFF_DIR``) and sends only their names, dtypes, shapes and offsets. The serving
process maps the file read-only, unlinks it at once and wraps the mapping in numpy arrays without
copying: the memory lives exactly as long as those arrays, and the arrays cannot be written to
(batches cut from decoded units are sent zero-copy, so nothing may change them). Where a file cannot be written (a
full /dev/shm, any OSError), the worker sends the arrays through its pipe instead: slower, never
a failure.

Names. Every worker pool has a folder of its own, ``PREFIX<serving pid>-<random>``, its
*incarnation*, holding ``lock`` and one file per task. The random part keeps a restarted server
that gets the same pid (a container's pid 1 after kill -9) clear of a dead run's files; the lock,
an flock held by the pool while it lives, tells a live incarnation from a dead one whatever its
pid says, so a dead one's files are swept even when its pid is alive again.

Who removes a file:
  * the serving process, right after mapping it (normal case);
  * the worker, for the file of its previous task, when its next message or EOF arrives (that file
    was either consumed already or will never be: the serving process is closing or gone);
  * the serving process, for the task a worker was running when it died, and for its pool's
    whole folder when the pool closes;
  * the workers of a serving process killed -9, for its folder, as they exit (they notice within
    a second);
  * any later pool's start (``sweep_dead``), for the folders whose lock nobody holds (the serving
    process and its workers all killed at once), and for files named as older versions named
    them, of processes that no longer exist.
"""

from __future__ import annotations

import fcntl
import glob
import mmap
import os
import re
import shutil
import tempfile
import time
from typing import Any, Mapping

import numpy as np

from fuelline.protocol.common.memfs import SHM, writable_shm

__all__ = [
    "ALIGN", "PREFIX", "ENV_DIR", "Layout", "Incarnation", "shm_dir", "shm_size", "write_arrays", "map_arrays",
    "unlink", "sweep_dead", "remove_if_dead",
]

ALIGN = 64  # bytes: a cache line, and more than any dtype's alignment
PREFIX = "fuelline-handoff-"  # an incarnation's folder is PREFIX + "<serving pid>-<random>"
ENV_DIR = "FUELLINE_HANDOFF_DIR"  # where hand-off files go, in place of /dev/shm
LOCK = "lock"
UNLOCKED_AGE = 60.0  # seconds after which a folder that never got its lock is a creator's remains

_LEGACY = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-(\d+)")  # one file per task, no folder

# Per array: (name, numpy dtype string, shape, offset in the file).
Layout = list[tuple[str, str, tuple[int, ...], int]]


def shm_dir() -> str:
    """``$FUELLINE_HANDOFF_DIR`` if set; else /dev/shm where it exists and is writable; else the
    temporary directory (on disk, but short-lived files mostly stay in the page cache)."""
    configured = os.environ.get(ENV_DIR)
    if configured:
        return configured
    if writable_shm():
        return SHM
    return tempfile.gettempdir()


def shm_size() -> int | None:
    """Bytes of the filesystem hand-off files live in, when it is RAM (/dev/shm: a container's
    is often 64 MB); None for a directory on disk. A mapped file keeps its space until its arrays
    are gone, unlinked or not."""
    directory = shm_dir()
    if directory != SHM:
        return None
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


class Incarnation:
    """A worker pool's folder of hand-off files, locked while the pool lives.

    Raises:
        OSError: the folder or its lock cannot be made (the pool then hands arrays over through
            its pipes).
    """

    def __init__(self, directory: str) -> None:
        self._fd: int | None = None
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=directory)
        try:
            # Locked under another name, then renamed: a sweep only judges a folder by its lock
            # once it has one, and by then it is held.
            pending = os.path.join(self.path, LOCK + ".new")
            self._fd = os.open(pending, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(pending, os.path.join(self.path, LOCK))
        except BaseException:
            self.remove()
            raise

    def task_path(self, task_id: int) -> str:
        return os.path.join(self.path, str(task_id))

    def clear(self) -> None:
        """Remove every task file (the folder and its lock stay)."""
        try:
            names = os.listdir(self.path)
        except OSError:
            return
        for name in names:
            if name != LOCK:
                unlink(os.path.join(self.path, name))

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)  # (after the folder is gone: a sweep never finds it unlocked)
            self._fd = None


def write_arrays(path: str, arrays: Mapping[str, Any]) -> tuple[Layout, int]:
    """Write ``arrays`` into a new file at ``path``; returns the layout and the file's size. Writes
    nothing when every array is empty (size 0). The space is reserved up front, so a full /dev/shm
    is an OSError here rather than a SIGBUS on a write through the mapping; after any OSError, no
    file this call made is left."""
    layout: Layout = []
    parts = []
    size = 0
    for name, value in arrays.items():
        a = np.ascontiguousarray(value)
        if a.dtype.hasobject:
            raise TypeError(f"array {name!r} has dtype {a.dtype}, which holds Python objects")
        size = -(-size // ALIGN) * ALIGN
        layout.append((name, a.dtype.str, tuple(int(n) for n in a.shape), size))
        parts.append((size, a))
        size += a.nbytes
    if size == 0:
        return layout, 0
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        for offset, a in parts:
            data = a.reshape(-1).view(np.uint8).data
            while len(data):  # (a write may be partial: Linux caps one at about 2 GiB)
                done = os.pwrite(fd, data, offset)
                data, offset = data[done:], offset + done
    except BaseException:
        unlink(path)
        raise
    finally:
        os.close(fd)
    return layout, size


def map_arrays(path: str | None, layout: Layout) -> dict[str, np.ndarray]:
    """The arrays a worker wrote, as read-only views of the file mapped here; the file is unlinked
    before this returns, whatever happens. ``path`` None: every array is empty."""
    mm: mmap.mmap | None = None
    if path is not None:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        finally:
            unlink(path)
    out = {}
    for name, dtype, shape, offset in layout:
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0 or mm is None:
            a = np.empty(shape, dtype=dtype)
        else:
            a = np.frombuffer(mm, dtype=dtype, count=count, offset=offset).reshape(shape)
        a.setflags(write=False)
        out[name] = a
    return out


def unlink(path: str | None) -> None:
    if path is None:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _held(folder: str, made: bool = False) -> bool:
    """Whether a live pool holds this incarnation's lock. A folder without its lock is one still
    being made, unless ``made`` (the caller knows it got its lock: then another cleaner is
    removing it)."""
    try:
        fd = os.open(os.path.join(folder, LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if made:
            return False
        try:
            return time.time() - os.stat(folder).st_mtime < UNLOCKED_AGE
        except OSError:
            return False
    except OSError:
        return True  # unreadable: not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True  # held (EWOULDBLOCK), or not ours to judge
    finally:
        os.close(fd)  # (drops the lock this probe may have taken)
    return False


def sweep_dead(directory: str) -> int:
    """Remove the hand-off folders whose pool is gone, whatever their pid, and files of the older
    one-file-per-task naming whose process is gone (or is this one, which never writes them);
    returns how many files went."""
    removed = 0
    for path in glob.glob(os.path.join(glob.escape(directory), PREFIX + "*")):
        name = os.path.basename(path)
        legacy = _LEGACY.fullmatch(name)
        if legacy:
            pid = int(legacy.group(1))
            if pid == os.getpid() or not _alive(pid):
                try:
                    os.unlink(path)
                    removed += 1
                except OSError:
                    pass
            continue
        removed += remove_if_dead(path)
    return removed


def remove_if_dead(folder: str, made: bool = False) -> int:
    """Remove an incarnation's folder if no live pool holds its lock; returns the task files it
    held. ``made``: the caller knows the folder got its lock (a worker of its pool), so a folder
    without one is the remains of a removal that a file written meanwhile kept from finishing
    (``shutil.rmtree`` took the lock, then could not remove the folder), not one being made."""
    if not os.path.isdir(folder) or os.path.islink(folder) or _held(folder, made):
        return 0
    try:
        files = sum(1 for n in os.listdir(folder) if n != LOCK)
    except OSError:
        files = 0
    shutil.rmtree(folder, ignore_errors=True)
    return files
