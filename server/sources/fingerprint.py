"""What a unit source tells its clients about the sequence it serves: the sequence fingerprint,
and a bounded account of what it left out.

The fingerprint of a split (``BatchSource.fingerprint``, sent in every ``Welcome``) is a map of
named parts of everything that decides which batch a position means: the files, the seed, the
batch size, the shuffle, the windowing and stages. A client holds a stream to the first
fingerprint it hears and refuses a server (restarted, or another of the same reader) whose
fingerprint differs, naming the part. So a part holds what changes the sequence and nothing else:

* files by their names relative to the dataset root, so the same files on two mounts, or under
  a local path and a URI, agree; their sizes, and for Parquet files the whole seconds of their
  modification times (a copy keeps those, where filesystems disagree on finer precision);
* never worker counts, caches, prefetch depth or where the dataset is mounted.

Values are short strings; a list (of files, of recordings) is its length and a digest.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Iterable, Mapping, Sequence

from fuelline.server.sources.storage import FileStat

__all__ = ["ORDER_VERSION", "digest", "files_part", "unit_parts", "callable_name", "text_part", "skipped_summary"]

# What ``fuelline.server.sources.ordering`` makes of the same inputs; a change there that moves rows to
# other positions changes this, so a client never joins an old position to a new order.
ORDER_VERSION = "1"
SHOWN_SKIPPED = 5  # shards or recordings left out that a Welcome lists; the log names every one
MAX_TEXT = 120  # characters of a part kept as they are; a longer one is cut and digested


def digest(items: Iterable[Any]) -> str:
    """A short hex digest of plain values (str, int, float, lists of those), in order."""
    h = hashlib.blake2b(digest_size=8)
    for item in items:
        h.update(json.dumps(item, sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def files_part(files: Sequence[FileStat], *, mtimes: bool) -> str:
    """``"4 files #<digest>"`` of the files' relative names, sizes and, with ``mtimes``, the whole
    seconds of their modification times."""
    entries = [
        [f.rel, f.size, None if f.mtime_ns is None else f.mtime_ns // 1_000_000_000] if mtimes else [f.rel, f.size]
        for f in files
    ]
    return f"{len(entries)} file{'s' * (len(entries) != 1)} #{digest(entries)}"


def unit_parts(batch_size: int, seed: int, shuffle: bool, shuffle_block: int) -> dict[str, str]:
    """The parts every unit source has: how its rows are ordered and cut into batches. Seed and
    shuffle block order nothing when rows are served in storage order, so they are left out then."""
    parts = {"order": ORDER_VERSION, "batch_size": str(batch_size), "shuffle": str(bool(shuffle)).lower()}
    if shuffle:
        parts.update(seed=str(seed), shuffle_block=str(shuffle_block))
    return parts


def callable_name(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a stage, as ``--stage`` names it."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}:{name}"


def text_part(text: str) -> str:
    """``text`` itself if short, else its start and a digest of the whole."""
    if len(text) <= MAX_TEXT:
        return text
    return f"{text[:MAX_TEXT - 20]}… #{digest([text])}"


def skipped_summary(skipped: Sequence[Mapping[str, str]], split: str, name: str) -> dict[str, Any]:
    """The shards (or recordings) of a split left out under ``--on-bad-shard skip``, as a Welcome
    carries them: how many, the first few, and how many more. Listing every one would outgrow a
    client's header limit with a few hundred, and nobody could connect."""
    mine = [x for x in skipped if x.get("split") == split]
    out: dict[str, Any] = {
        name: [{**x, "reason": _cut(x.get("reason", ""), 1000)} for x in mine[:SHOWN_SKIPPED]],
        f"{name}_count": len(mine),
    }
    if len(mine) > SHOWN_SKIPPED:
        out[f"{name}_more"] = f"{len(mine) - SHOWN_SKIPPED} more left out; the server's log names every one"
    return out


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
