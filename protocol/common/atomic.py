"""Write a whole folder so that it appears complete or not at all."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import traceback
from typing import Callable, Iterator

from fuelline.protocol.common.diskspace import folder_bytes, free_bytes, is_out_of_space, out_of_space

__all__ = ["atomic_directory"]


@contextlib.contextmanager
def atomic_directory(out: str, what: str = "output", needed: Callable[[], int | None] | None = None) -> Iterator[str]:
    """Yield a fresh hidden folder beside ``out``; rename it to ``out`` when the block succeeds.

    The folder is made in ``out``'s parent, so the final rename stays on one file system and is
    atomic. If the block raises, or ``out`` appears meanwhile, the folder is removed and nothing
    is left at ``out``; an existing ``out`` is never replaced.

    Args:
        out: the folder to create; its parent is created if missing.
        what: how messages name ``out`` (``"dataset"``, ``"key folder"``).
        needed: an estimate of the bytes ``out`` will take, asked only when the disk fills up,
            for the message; None: the message says what was written before it did.

    Raises:
        FileExistsError: ``out`` exists before or after the block; it is left untouched.
        DataError: the file system (or the quota) ran out of space, in the block or here; the
            message names ``out``, the space it needs and the space free. Nothing is left at ``out``.
    """
    if os.path.lexists(out):
        raise FileExistsError(f"{what} {out} already exists; remove it or choose another path")
    parent, name = os.path.split(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    temporary = os.path.join(parent, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    free = free_bytes(parent)  # (a folder that fills the disk needed more than this)
    try:
        os.mkdir(temporary)
    except OSError as exc:
        if is_out_of_space(exc):
            raise out_of_space(out, what, exc, free, 0, needed() if needed is not None else None) from exc
        raise
    try:
        yield temporary
        if os.path.lexists(out):
            raise FileExistsError(f"{what} {out} appeared while it was being written; the new one was discarded")
        os.rename(temporary, out)
    except BaseException as exc:
        full = is_out_of_space(exc)
        written = folder_bytes(temporary) if full else 0
        shutil.rmtree(temporary, ignore_errors=True)
        if full:
            _close_files_of(exc)
            raise out_of_space(out, what, exc, free, written, needed() if needed is not None else None) from exc
        raise


def _close_files_of(exc: BaseException) -> None:
    """Let go of what the failed block's finished frames hold: a writer that failed to close
    (pyarrow's, on a full disk) keeps its file open, and the removed file its space, for as long
    as the error's traceback keeps the writer, which is as long as the caller keeps the error."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)  # (frames still running, this one's caller's, are left)
        error = error.__context__
