"""Write a whole folder so that it appears complete or not at all."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from typing import Iterator

__all__ = ["atomic_directory"]


@contextlib.contextmanager
def atomic_directory(out: str, what: str = "output") -> Iterator[str]:
    """Yield a fresh hidden folder beside ``out``; rename it to ``out`` when the block succeeds.

    The folder is made in ``out``'s parent, so the final rename stays on one file system and is
    atomic. If the block raises, or ``out`` appears meanwhile, the folder is removed and nothing
    is left at ``out``; an existing ``out`` is never replaced.

    Args:
        out: the folder to create; its parent is created if missing.
        what: how messages name ``out`` (``"dataset"``, ``"key folder"``).

    Raises:
        FileExistsError: ``out`` exists before or after the block; it is left untouched.
    """
    if os.path.lexists(out):
        raise FileExistsError(f"{what} {out} already exists; remove it or choose another path")
    parent, name = os.path.split(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    temporary = os.path.join(parent, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(temporary)
    try:
        yield temporary
        if os.path.lexists(out):
            raise FileExistsError(f"{what} {out} appeared while it was being written; the new one was discarded")
        os.rename(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
