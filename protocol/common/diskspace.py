"""A full disk, told as such: what a writer of a whole folder (``atomic_directory``: convert,
synth, the sample dataset) raises when the file system fills up under it, instead of the
``OSError: [Errno 28]`` traceback from deep inside pyarrow."""

from __future__ import annotations

import errno
import os

from fuelline.protocol.errors import DataError

__all__ = ["is_out_of_space", "folder_bytes", "free_bytes", "show_bytes", "out_of_space"]

_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a write that found no space or quota left.
    pyarrow's OSError carries the errno as Python's does."""
    for error in (exc, exc.__cause__):
        if isinstance(error, OSError) and (error.errno in _FULL or "No space left on device" in str(error)):
            return True
    return False


def folder_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (0 for what cannot be read)."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass  # (removed meanwhile)
    return total


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged user may still write on the file system of ``path``; None if unknown."""
    try:
        stat = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return stat.f_bavail * stat.f_frsize


def show_bytes(n: float) -> str:
    """``n`` bytes as people read them: 512 B, 3.4 kB, 1.9 MB, 2.0 GB (powers of 1000, as the
    commands print sizes)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _mount_point(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def out_of_space(out: str, what: str, exc: BaseException, free: int | None, written: int,
                 needed: int | None) -> DataError:
    """The error for a write of ``what`` at ``out`` that ran out of space.

    Args:
        free: bytes free on its file system when the writing started (None if unknown). It is
            what the message says is free: the space free once the error is raised may still be
            held by files the failed writer has open, until they are collected.
        written: bytes found in the folder when the error came (a writer such as pyarrow removes
            the file it could not finish, so this may be less than it wrote).
        needed: an estimate of the bytes the whole folder takes; None, or one not above what
            surely was needed (the free space, or what was written), says "more than" that.
    """
    parent = os.path.dirname(os.path.abspath(out))
    quota = isinstance(exc, OSError) and exc.errno == errno.EDQUOT
    why = "the disk quota ran out" if quota else f"the file system at {_mount_point(parent)} is full"
    at_least = max(free or 0, written)
    need = f"about {show_bytes(needed)}" if needed is not None and needed > at_least else f"more than {show_bytes(at_least)}"
    had = f"{show_bytes(free)} was free there" if free is not None else "how much was free there is unknown"
    return DataError(
        f"no space left to write {what} {out}: {why}; the {what} needs {need} and {had} when it started; "
        f"nothing was left at {out}: free some space or choose another folder"
    )
