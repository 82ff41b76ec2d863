"""What a unit source tells its clients about the sequence it serves: the sequence fingerprint,
and a bounded account of what it left out.

The fingerprint of a split (``BatchSource.fingerprint``, sent in every ``Welcome``) is a map of
named parts of everything that decides which batch a position means: the files, the seed, the
batch size, the shuffle, the windowing and stages. A client holds a stream to the first
fingerprint it hears and refuses a server (restarted, or another of the same reader) whose
fingerprint differs, naming the part. So a part holds what changes the sequence and nothing else:

* files by their names relative to the dataset root and their sizes, so the same files on two
  mounts, or under a local path and a URI, agree; never their modification times, which a copy
  may or may not keep, and which a copy that keeps them (``cp -p``, ``rsync -t``) makes worthless;
* what the files hold, from what is cheap to read and never from the data itself: the footer of
  every Parquet file (row groups, their rows and byte sizes, column statistics, encodings,
  offsets, key-value metadata), hashed as stored (``read_parquet_footer``), and the footer of
  every grid file a converted dataset serves (``arrow_footer_digest``). Files fuelline writes hold
  an xxh3 of their data in that metadata (``CONTENT_KEY``), so their footers change whenever their
  data does; another writer's files are told apart by statistics, sizes and offsets alone;
* the code of the user's stages (``stage_code_part``);
* never worker counts, caches, prefetch depth or where the dataset is mounted.

Values are short strings; a list (of files, of recordings) is its length and a digest.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import xxhash

from fuelline.protocol.errors import DataError
from fuelline.server.sources.code_digest import callable_digest
from fuelline.server.sources.storage import FileStat, Store

if TYPE_CHECKING:
    import pyarrow.parquet as pq

__all__ = ["CONTENT_KEY", "ContentDigest", "digest", "files_part", "content_part", "unit_parts",
           "callable_name", "stage_code_part", "text_part", "skipped_summary", "read_parquet_footer",
           "arrow_footer_digest", "grid_footers_part", "open_for_footer"]

SHOWN_SKIPPED = 5  # shards or recordings left out that a Welcome lists; the log names every one
MAX_TEXT = 120  # characters of a part kept as they are; a longer one is cut and digested
# The key, in a file's metadata (Parquet key-value metadata, an Arrow file's schema), of the xxh3 of
# the data fuelline wrote into it.
CONTENT_KEY = "fuelline.xxh3"
# Bytes read at once from a file's end: the whole footer of nearly every file, in one request
# (a remote file's range read costs a round trip whatever its length, up to a few hundred kB).
TAIL = 64 * 1024


def digest(items: Iterable[Any]) -> str:
    """A short hex digest of plain values (str, int, float, lists of those), in order."""
    h = hashlib.blake2b(digest_size=8)
    for item in items:
        h.update(json.dumps(item, sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def files_part(files: Sequence[FileStat]) -> str:
    """``"4 files #<digest>"`` of the files' relative names and sizes."""
    return _count_part([[f.rel, f.size] for f in files])


def content_part(footers: Sequence[Any]) -> str:
    """``"4 files #<digest>"`` of the files' footer digests (or whatever stands for a file's
    content), in the files' order."""
    return _count_part(list(footers))


def _count_part(entries: list) -> str:
    return f"{len(entries)} file{'s' * (len(entries) != 1)} #{digest(entries)}"


class ContentDigest:
    """The xxh3 of the arrays a writer stores, in order, each with its dtype and shape: what
    fuelline puts under ``CONTENT_KEY`` in the metadata of a file it writes, so that the file's
    footer changes whenever its data does, even where its statistics and sizes would not."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, *arrays: np.ndarray) -> None:
        for a in arrays:
            a = np.ascontiguousarray(a)
            self._h.update(f"{a.dtype.str}{a.shape}".encode())
            self._h.update(a.reshape(-1).view(np.uint8).data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def open_for_footer(store: Store, rel: str) -> pa.NativeFile:
    """A file to read a footer from: by range where remote, a plain file where local (mapping a
    file costs more than the one read of its end that is all a footer takes)."""
    return store.open(rel) if store.remote else pa.OSFile(store.local_path(rel))


def _tail(handle: pa.NativeFile, size: int, length: int, what: str) -> bytes:
    if size < length:
        raise ValueError(f"{what}: the file holds {size} bytes, fewer than its footer needs ({length})")
    return handle.read_at(length, size - length)


def read_parquet_footer(handle: pa.NativeFile) -> tuple[pq.FileMetaData, str]:
    """A Parquet file's footer, parsed, and the xxh3 of its bytes as stored (the serialized
    FileMetaData, its length and the magic): one read of the file's end (two where the footer is
    longer than ``TAIL``), by range where the file is remote, and nothing of its data. The bytes
    are hashed rather than the parsed footer: they are exactly what the writer stored, whichever
    pyarrow reads them.

    Raises:
        ValueError, OSError, pyarrow.ArrowException: not a Parquet file, or not readable.
    """
    import pyarrow.parquet as pq

    size = handle.size()
    tail = _tail(handle, size, min(size, TAIL), "Parquet footer")
    if len(tail) < 12 or tail[-4:] != b"PAR1":
        raise ValueError("Parquet magic bytes not found in footer: the file is corrupted or not a Parquet file")
    length = int.from_bytes(tail[-8:-4], "little") + 8
    if length > len(tail):
        tail = _tail(handle, size, length, "Parquet footer")
    footer = tail[-length:]
    return pq.read_metadata(pa.BufferReader(footer)), xxhash.xxh3_64_hexdigest(footer)


def arrow_footer_digest(handle: pa.NativeFile) -> str:
    """The xxh3 of an Arrow IPC file's footer as stored (its schema with the schema's metadata,
    and where each record batch lies): one read of the file's end, nothing of its data.

    Raises:
        ValueError, OSError: not an Arrow file, or not readable.
    """
    size = handle.size()
    tail = _tail(handle, size, min(size, TAIL), "Arrow footer")
    if len(tail) < 10 or tail[-6:] != b"ARROW1":
        raise ValueError("not an Arrow IPC file (no magic at its end)")
    length = int.from_bytes(tail[-10:-6], "little", signed=True) + 10
    if length > len(tail):
        tail = _tail(handle, size, length, "Arrow footer")
    return xxhash.xxh3_64_hexdigest(tail[-length:])


def unit_parts(batch_size: int, seed: int, shuffle: bool, shuffle_block: int, order_version: int) -> dict[str, str]:
    """The parts every unit source has: how its rows are ordered and cut into batches. Seed and
    shuffle block order nothing when rows are served in storage order, so they are left out then.
    ``order`` is the version of ``fuelline.server.sources.epoch_plan`` that orders them: one that
    moves rows to other positions has a number of its own, so a client never joins a position
    of one to another. Storage order is the same in every version, so an unshuffled source keeps
    the first's number: positions saved in it resume on any."""
    parts = {"order": str(order_version if shuffle else 1), "batch_size": str(batch_size), "shuffle": str(bool(shuffle)).lower()}
    if shuffle:
        parts.update(seed=str(seed), shuffle_block=str(shuffle_block))
    return parts


def callable_name(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a stage, as ``--stage`` names it."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}:{name}"


def grid_footers_part(store: Store, files: Sequence[str]) -> str:
    """``"4 files #<digest>"`` of Arrow files' (a converted dataset's grid files') relative names,
    sizes and footers: one read of each file's end. A file that cannot be read counts as such:
    the read that needs it names the problem, as it would without a fingerprint."""
    entries: list[list[Any]] = []
    for rel in files:
        try:
            with open_for_footer(store, rel) as handle:
                entries.append([rel, handle.size(), arrow_footer_digest(handle)])
        except (OSError, ValueError, DataError):
            entries.append([rel, None, "unreadable"])
    return content_part(entries)


def stage_code_part(stages: Sequence[Callable[..., Any]]) -> str:
    """``"mod:fn #<digest>,…"``: each stage with the digest of its code
    (``fuelline.server.sources.code_digest.callable_digest``), so that a stage edited under the
    same name is a part that differs, naming the stage."""
    return text_part(",".join(f"{callable_name(s)} #{callable_digest(s)}" for s in stages))


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
