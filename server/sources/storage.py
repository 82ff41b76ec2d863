"""Where a dataset's files live: a local folder, or any filesystem pyarrow reaches by URI.

A DATASET is a plain local path, ``file:///abs/path``, ``s3://bucket/prefix`` or whatever
``pyarrow.fs.FileSystem.from_uri`` resolves (``gs://``, ``hdfs://``...). Sources read a dataset
only through a ``Store``, so they need not know which it is:

* ``list`` / ``stat`` / ``kind``: the files under a folder, their sizes and modification times;
* ``open``: a random-access file, read by range (a Parquet footer, one column of one row group)
  without fetching the whole object;
* ``open_local``: a local memory map of a whole file, for decoding. For a local dataset it is the
  file itself (no copy, exactly what the sources did before remote datasets existed); for a
  remote one it is the copy in the disk cache (``fuelline.server.cache.disk``), fetched on first use.

S3 settings: credentials, region and endpoint come from the usual AWS environment variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``,
``AWS_ENDPOINT_URL``) or config files, and/or from URI query parameters that pyarrow understands
(``?region=…&scheme=http&endpoint_override=host:port``, ``allow_bucket_creation`` …). Credentials
in a URI (``s3://KEY:SECRET@bucket/prefix``) work too but are never shown: every message names
the dataset by its URI with the user info and query left out.

A store is picklable: worker processes get a copy that resolves the URI again on first use and
shares the on-disk cache (its locks are files), but not this process's threads.
"""

from __future__ import annotations

import logging
import os
import posixpath
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.fs as pafs

from fuelline.protocol import DataError
from fuelline.protocol.common.threadnames import name_this_thread
from fuelline.server.sources.locations import default_cache_dir, is_uri, redact_uri

__all__ = ["Store", "FileStat", "is_uri", "redact_uri", "default_cache_dir", "storage_info", "STORAGE_COUNTERS"]

log = logging.getLogger("fuelline.server")

PREFETCH_THREADS = 2  # fetching is network-bound; a couple of streams keep ahead of decoding
PREFETCH_QUEUE = 64  # requests beyond this many pending are dropped: the read fetches on demand


@dataclass(frozen=True)
class FileStat:
    """A file of the dataset: its path relative to the dataset root, size and mtime (ns, or None
    where the filesystem has none)."""

    rel: str
    size: int
    mtime_ns: int | None


def _check_rel(rel: str) -> str:
    parts = rel.replace("\\", "/").split("/")
    if rel.startswith("/") or ".." in parts:
        raise DataError(f"{rel!r} is not a path inside the dataset")
    return "/".join(p for p in parts if p)


class Store:
    """A dataset root, local or remote. See the module docstring.

    Args:
        dataset: a local path or a URI.
        cache_dir: where remote files are copied (default ``default_cache_dir()``); unused for
            local datasets.
        cache_mb: the cache's budget in megabytes (10**6 bytes), for all datasets in cache_dir
            together.
        counters: where cache and fetch events are counted (the source's ``counters``).

    Raises:
        DataError: a URI pyarrow cannot resolve (unknown scheme, malformed options).
    """

    def __init__(
        self, dataset: str, *, cache_dir: str | None = None, cache_mb: float = 10240, counters: Counter | None = None,
    ) -> None:
        self.dataset = dataset
        self.uri = redact_uri(dataset)
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self.cache_dir = cache_dir or default_cache_dir()
        self.cache_mb = cache_mb
        self._stats: dict[str, FileStat] = {}
        self._fs: pafs.FileSystem | None = None
        if is_uri(dataset):
            fs, root = self._resolve()
            self.remote = not isinstance(fs, pafs.LocalFileSystem)
            self.root = root.rstrip("/") if self.remote else root
            if self.remote:
                self._fs = fs
        else:
            self.remote = False
            self.root = dataset
        self._init_local_state()

    def _init_local_state(self) -> None:
        """What each process has of its own: threads, locks, the cache's in-process memory."""
        self._lock = threading.Lock()
        self._closing = threading.Event()  # set by close(): a fetch under way stops early
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: set[str] = set()
        self._cache: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_lock", "_closing", "_pool", "_inflight", "_cache", "_fs"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fs = None  # resolved again on first use, in this process
        self._init_local_state()

    # -- resolving -------------------------------------------------------------------------------
    def _resolve(self) -> tuple[pafs.FileSystem, str]:
        try:
            return pafs.FileSystem.from_uri(self.dataset)
        except Exception as exc:
            raise DataError(f"dataset {self.uri!r}: cannot open its filesystem ({exc})") from None

    @property
    def fs(self) -> pafs.FileSystem:
        fs = self._fs
        if fs is None:
            fs = self._fs = self._resolve()[0]
        return fs

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter; safe from the prefetch threads."""
        add = getattr(self.counters, "add", None)
        if add is not None:
            add(name, n)  # the source's Counts: the same lock as every other thread counting there
            return
        with self._lock:
            self.counters[name] += n

    # -- names -----------------------------------------------------------------------------------
    def _full(self, rel: str) -> str:
        if not rel:
            return self.root
        return posixpath.join(self.root, rel) if self.remote else os.path.join(self.root, rel)

    def where(self, rel: str = "") -> str:
        """How messages name a file: its local path, or its URI without credentials."""
        if not self.remote:
            return self._full(rel)
        return f"{self.uri}/{rel}" if rel else self.uri

    def local_path(self, rel: str) -> str:
        """The path of a file of a local dataset (what ``open_local`` maps)."""
        if self.remote:
            raise ValueError(f"{self.uri} is not local")
        return self._full(rel)

    def _error(self, rel: str, what: str, exc: BaseException) -> DataError:
        return DataError(f"{self.where(rel)}: cannot {what} ({exc})")

    # -- listing ---------------------------------------------------------------------------------
    def kind(self, rel: str = "") -> str | None:
        """"file", "dir", or None if nothing is there."""
        rel = _check_rel(rel)
        if not self.remote:
            path = self._full(rel)
            return "file" if os.path.isfile(path) else "dir" if os.path.isdir(path) else None
        try:
            info = self.fs.get_file_info(self._full(rel))
        except Exception as exc:
            raise self._error(rel, "look it up", exc) from None
        if info.type == pafs.FileType.File:
            self._remember(rel, info)
            return "file"
        return "dir" if info.type == pafs.FileType.Directory else None

    def missing(self, rel: str = "") -> str:
        """Why nothing is at ``rel``, as precisely as the filesystem tells (a missing bucket)."""
        if self.remote and isinstance(self.fs, pafs.S3FileSystem) and not rel:
            bucket = self.root.split("/", 1)[0]
            try:
                gone = self.fs.get_file_info(bucket).type == pafs.FileType.NotFound
            except Exception as exc:
                return f"dataset {self.where(rel)!r}: cannot reach bucket {bucket!r} ({exc})"
            if gone:
                return f"dataset {self.where(rel)!r}: bucket {bucket!r} does not exist (or these credentials cannot see it)"
        return f"dataset {self.where(rel)!r} does not exist"

    def _remember(self, rel: str, info: pafs.FileInfo) -> FileStat:
        st = FileStat(rel, int(info.size), info.mtime_ns)
        self._stats[rel] = st
        return st

    def list(self, rel: str = "") -> tuple[list[FileStat], list[str]]:
        """The files and the folders directly in ``rel``, sorted by name (relative paths)."""
        rel = _check_rel(rel)
        files: list[FileStat] = []
        dirs: list[str] = []
        if not self.remote:
            folder = self._full(rel)
            try:
                names = sorted(os.listdir(folder))
            except OSError as exc:
                raise self._error(rel, "list it", exc) from None
            for name in names:
                path = os.path.join(folder, name)
                child = posixpath.join(rel, name) if rel else name
                if os.path.isfile(path):
                    st = os.stat(path)
                    files.append(FileStat(child, st.st_size, st.st_mtime_ns))
                elif os.path.isdir(path):
                    dirs.append(child)
            return files, dirs
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self._full(rel), recursive=False))
        except Exception as exc:
            raise self._error(rel, "list it", exc) from None
        base = self._full(rel).rstrip("/") + "/"
        for info in sorted(infos, key=lambda i: i.path):
            child = _check_rel(info.path[len(base):] if info.path.startswith(base) else info.base_name)
            child = posixpath.join(rel, child) if rel else child
            if info.type == pafs.FileType.File:
                files.append(self._remember(child, info))
            elif info.type == pafs.FileType.Directory:
                dirs.append(child)
        return files, dirs

    def stat(self, rel: str) -> FileStat:
        """Size and mtime of a file (remote: as listed at start-up, or looked up once)."""
        rel = _check_rel(rel)
        if not self.remote:
            try:
                st = os.stat(self._full(rel))
            except OSError as exc:
                raise self._error(rel, "stat it", exc) from None
            return FileStat(rel, st.st_size, st.st_mtime_ns)
        known = self._stats.get(rel)
        if known is not None:
            return known
        try:
            info = self.fs.get_file_info(self._full(rel))
        except Exception as exc:
            raise self._error(rel, "look it up", exc) from None
        if info.type != pafs.FileType.File:
            raise DataError(f"{self.where(rel)}: no such file")
        return self._remember(rel, info)

    def total_bytes(self) -> int:
        """Bytes of every file under the root (0 if nothing is there)."""
        if not self.remote:
            root = self.root
            if os.path.isfile(root):
                return os.path.getsize(root)
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
        kind = self.kind()
        if kind is None:
            return 0
        if kind == "file":
            return self.stat("").size
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, recursive=True))
        except Exception as exc:
            raise self._error("", "list it", exc) from None
        return sum(int(i.size) for i in infos if i.type == pafs.FileType.File)

    # -- reading ---------------------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes:
        """A small file whole (a manifest). OSError (FileNotFoundError if absent) for local files,
        DataError for remote ones."""
        rel = _check_rel(rel)
        if not self.remote:
            with open(self._full(rel), "rb") as f:
                return f.read()
        try:
            with self.fs.open_input_stream(self._full(rel)) as f:
                return f.read()
        except Exception as exc:
            raise self._error(rel, "read it", exc) from None

    def open(self, rel: str) -> pa.NativeFile:
        """A random-access file, read by range: a local memory map, or a remote file whose reads
        fetch only the bytes asked for."""
        rel = _check_rel(rel)
        if not self.remote:
            return pa.memory_map(self._full(rel))
        try:
            return self.fs.open_input_file(self._full(rel))
        except Exception as exc:
            raise self._error(rel, "open it", exc) from None

    def open_local(self, rel: str) -> pa.MemoryMappedFile:
        """A memory map of the whole file: the file itself if local, else its disk-cache copy."""
        rel = _check_rel(rel)
        if not self.remote:
            return pa.memory_map(self._full(rel))
        return self._disk().open(rel, self.stat(rel))

    def fetch(self, rel: str, out: Any, chunk: int = 8 << 20) -> int:
        """Copy a remote file into ``out`` (``write``), in chunks; calls ``out.update`` too if it
        has one. Returns the bytes copied. Used by the disk cache."""
        try:
            with self.fs.open_input_stream(self._full(rel)) as f:
                n = 0
                while True:
                    if self._closing.is_set():
                        raise DataError(f"{self.where(rel)}: fetch stopped, the source is closing")
                    block = f.read(chunk)
                    if not block:
                        return n
                    out.write(block)
                    n += len(block)
        except DataError:
            raise
        except Exception as exc:
            raise self._error(rel, "fetch it", exc) from None

    def _disk(self) -> Any:
        with self._lock:
            if self._cache is None:
                from fuelline.server.cache.disk import DiskCache

                self._cache = DiskCache(self, self.cache_dir, int(self.cache_mb * 1_000_000))
            return self._cache

    # -- prefetching -----------------------------------------------------------------------------
    def prefetch(self, rels: Iterable[str]) -> None:
        """Fetch these files into the disk cache on background threads; returns at once. A file
        already requested and not done yet is not requested again; a local store has nothing to do."""
        if not self.remote:
            return
        for rel in rels:
            rel = _check_rel(rel)
            with self._lock:
                if rel in self._inflight or len(self._inflight) >= PREFETCH_QUEUE:
                    continue
                self._inflight.add(rel)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=PREFETCH_THREADS, thread_name_prefix="fuelline-fetch",
                                                    initializer=name_this_thread, initargs=("fl-fetch",))
                pool = self._pool
            try:
                pool.submit(self._prefetch_one, rel)
            except RuntimeError:  # shut down meanwhile
                with self._lock:
                    self._inflight.discard(rel)

    def _prefetch_one(self, rel: str) -> None:
        try:
            self._disk().ensure(rel, self.stat(rel))
        except Exception as exc:  # the read that needs the file fetches it again and reports
            log.debug("prefetching %s failed: %s", self.where(rel), exc)
        finally:
            with self._lock:
                self._inflight.discard(rel)

    def close(self) -> None:
        """Stop the prefetch threads; a fetch under way stops at its next chunk (and leaves no copy),
        so a server that is told to stop does not wait for a big download."""
        self._closing.set()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


STORAGE_COUNTERS = (
    "cache_disk_hits", "cache_disk_misses", "cache_disk_evictions", "cache_disk_corrupt", "remote_fetches", "remote_bytes",
)


def storage_info(store: Store) -> dict[str, Any]:
    """Where a source reads from, and (remote) its disk-cache counters so far in this process:
    part of a source's ``info``, so a client's welcome and the log show them."""
    out: dict[str, Any] = {"dataset": store.uri, "remote": store.remote}
    if store.remote:
        out["cache_dir"] = store.cache_dir
        out["cache_mb"] = store.cache_mb
        with store._lock:
            out["counters"] = {k: int(store.counters[k]) for k in STORAGE_COUNTERS}
    return out
