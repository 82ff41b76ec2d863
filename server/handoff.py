"""Decoded arrays from a worker process to the serving process through a shared-memory file.

A worker writes a unit's arrays one after another (each aligned to ``ALIGN`` bytes) into one file
in /dev/shm (a RAM-backed filesystem; the temporary directory where there is none) and sends only
their names, dtypes, shapes and offsets. The serving process maps the file read-only, unlinks it
at once and wraps the mapping in numpy arrays without copying: the memory lives exactly as long as
those arrays, and the arrays cannot be written to (block tables are sent zero-copy, so nothing may
change them).

Who removes a file:
  * the serving process, right after mapping it (normal case);
  * the worker, for the file of its previous task, when its next message or EOF arrives (that file
    was either consumed already or will never be: the serving process is closing or gone);
  * the serving process, for the task a worker was running when it died, and for every file of
    its pool when it closes (``sweep``);
  * any later pool's start, for the files of processes that no longer exist (both the serving
    process and its worker killed -9 between a write and the unlink: the one window left).
"""

from __future__ import annotations

import glob
import mmap
import os
import re
import tempfile
from typing import Any, Mapping

import numpy as np

__all__ = ["ALIGN", "PREFIX", "Layout", "shm_dir", "shm_size", "write_arrays", "map_arrays", "unlink", "sweep_dead"]

ALIGN = 64  # bytes: a cache line, and more than any dtype's alignment
PREFIX = "fuelline-handoff-"  # files are PREFIX + "<serving pid>-<pool>-<task>"

_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-(\d+)")

# Per array: (name, numpy dtype string, shape, offset in the file).
Layout = list[tuple[str, str, tuple[int, ...], int]]


def shm_dir() -> str:
    """/dev/shm where it exists and is writable, else the temporary directory (on disk, but
    short-lived files mostly stay in the page cache)."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def shm_size() -> int | None:
    """Bytes of the filesystem hand-off files live in, when it is RAM (/dev/shm: a container's
    is often 64 MB); None for the temporary directory on disk. A mapped file keeps its space
    until its arrays are gone, unlinked or not."""
    directory = shm_dir()
    if directory != "/dev/shm":
        return None
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def write_arrays(path: str, arrays: Mapping[str, Any]) -> tuple[Layout, int]:
    """Write ``arrays`` into a new file at ``path``; returns the layout and the file's size. Writes
    nothing when every array is empty (size 0). The space is reserved up front, so a full /dev/shm
    is an OSError here rather than a SIGBUS on a write through the mapping."""
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
            data = memoryview(a.reshape(-1).view(np.uint8))
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


def sweep_dead(directory: str) -> int:
    """Remove hand-off files left by serving processes that no longer exist; returns how many."""
    removed = 0
    for path in glob.glob(os.path.join(directory, PREFIX + "*-*-*")):
        match = _NAME.fullmatch(os.path.basename(path))
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
    return removed
