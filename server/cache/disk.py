"""The disk tier: local copies of a remote dataset's files, so they are memory-mapped like local ones.

Layout, under ``--cache-dir`` (shared by every dataset, under one ``--cache-mb`` budget)::

    <cache-dir>/.evict.lock             held while anyone evicts
    <cache-dir>/<hash of the URI>/
        source.txt                      the dataset's URI (without credentials), for people
        data/<rel>                      the copy
        meta/<rel>.json                 its sidecar: remote size and mtime, xxh3 of the bytes
        locks/<rel>.lock                flock'ed while the copy is checked, opened or fetched

Why it is built this way:

* Several processes (the server and its workers) share one cache. A per-file ``flock`` makes the
  first process fetch a file while the others wait and then use the copy it made; lock files are
  never deleted, so two processes can never hold "the" lock on two different inodes.
* A copy is written to a temporary file, checksummed while it streams, fsync'ed and renamed into
  place, then its sidecar likewise: a crash leaves either no copy, or one whose sidecar disagrees
  with it (caught by the checks below).
* On use, the copy's size is checked every time, its xxh3 once per process (first use), and the
  sidecar's remote size and mtime against the remote listing. A corrupt copy is reported (WARNING
  naming it, ``cache_disk_corrupt``) and fetched again; a changed remote object is fetched again.
* Eviction (least recently used first: a use touches the copy's mtime) takes the eviction lock,
  and skips a copy whose file lock someone holds. It runs before a fetch (room for it), after
  (fetches side by side each made room for themselves alone), and on the next use if that left
  the cache over budget because copies were in use. A reader that already mapped a copy keeps its
  map after the unlink (Linux semantics), so eviction never breaks a read under way.
* A file bigger than the whole budget is still cached and used (with one warning).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import logging
import os
import threading
import time
from typing import Any, Iterator, Protocol

import pyarrow as pa
import xxhash

from fuelline.protocol import DataError

__all__ = ["DiskCache", "RemoteFiles", "RemoteStat", "dataset_key"]

log = logging.getLogger("fuelline.server")

EVICT_LOCK = ".evict.lock"
LOCK_TIMEOUT = 600.0  # seconds to wait for another process's fetch of the same file
OPEN_TRIES = 3


class RemoteStat(Protocol):
    """What the cache needs to know of a remote file to tell whether its copy is current."""

    size: int
    mtime_ns: int


class RemoteFiles(Protocol):
    """The remote files the cache copies (``fuelline.server.sources.storage.Store`` is one). The
    cache is handed its store, so the two need not import each other."""

    dataset: str
    uri: str
    root: str

    def fetch(self, rel: str, out: Any) -> int:
        """Write the remote file ``rel`` to ``out`` (``write(bytes)``); returns bytes written."""

    def where(self, rel: str) -> str:
        """``rel`` as a person reads it, for messages."""

    def count(self, name: str, n: int = 1) -> None:
        """Add to one of the store's event counts."""


def dataset_key(store: RemoteFiles) -> str:
    """The folder of a dataset in the cache: a hash of its URI, and of the S3 endpoint taken from
    the environment (the same ``s3://bucket/prefix`` on another endpoint is another dataset)."""
    text = store.dataset
    if store.dataset.startswith("s3://"):
        text += "\n" + os.environ.get("AWS_ENDPOINT_URL", "") + "\n" + os.environ.get("AWS_ENDPOINT_URL_S3", "")
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _file_checksum(path: str, chunk: int = 8 << 20) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return h.hexdigest()
            h.update(block)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _flock(path: str, what: str, timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if needed), waiting at most ``timeout``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # Another process fetches or checks this file; it lets go when done. Backing off
                # (not a fixed sleep) bounds both the wait and the polling.
                if time.monotonic() > deadline:
                    raise DataError(f"{what}: still locked by another process after {timeout:.0f}s ({path})") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


class _Writer:
    """What a fetch writes to: the temporary file, and the checksum as the bytes go by."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.hash = xxhash.xxh3_64()

    def write(self, block: bytes) -> None:
        self.f.write(block)
        self.hash.update(block)


class DiskCache:
    """One dataset's files in the disk tier (see the module docstring).

    Args:
        store: the remote store the files come from (``fetch``, ``where``, ``count``).
        base: the cache directory shared by all datasets.
        budget: bytes all datasets' copies in ``base`` may take together.
    """

    def __init__(self, store: RemoteFiles, base: str, budget: int) -> None:
        self.store = store
        self.base = os.path.abspath(base)
        self.dir = os.path.join(self.base, dataset_key(store))
        self.budget = budget
        self._verified: set[tuple[str, int, str]] = set()  # (rel, inode, checksum) checked in this process
        self._warned_big: set[str] = set()
        self._lock = threading.Lock()
        self._over = False  # the last trim left the cache over budget (copies in use were kept)

    # -- paths -----------------------------------------------------------------------------------
    def _name(self, rel: str) -> str:
        return rel or os.path.basename(self.store.root) or "dataset"

    def data_path(self, rel: str) -> str:
        return os.path.join(self.dir, "data", self._name(rel))

    def meta_path(self, rel: str) -> str:
        return os.path.join(self.dir, "meta", self._name(rel) + ".json")

    def lock_path(self, rel: str) -> str:
        return os.path.join(self.dir, "locks", self._name(rel) + ".lock")

    # -- use -------------------------------------------------------------------------------------
    def open(self, rel: str, remote: RemoteStat) -> pa.MemoryMappedFile:
        """A memory map of the cached copy of ``rel``, fetched (or fetched again) as needed."""
        return self._get(rel, remote, want_map=True)

    def ensure(self, rel: str, remote: RemoteStat) -> None:
        """Have a good copy of ``rel`` on disk (prefetching): fetches, but counts no hit."""
        self._get(rel, remote, want_map=False)

    def _get(self, rel: str, remote: RemoteStat, want_map: bool) -> Any:
        where = self.store.where(rel)
        for _attempt in range(OPEN_TRIES):
            with _flock(self.lock_path(rel), where):
                if not self._good(rel, remote):
                    self.store.count("cache_disk_misses")
                    self._fetch(rel, remote)
                elif want_map:
                    self.store.count("cache_disk_hits")
                path = self.data_path(rel)
                try:
                    # The least recently used go first. An explicit time: the kernel's own
                    # stamps are coarse (a tick), and uses within one tick must still be ordered.
                    now = time.time_ns()
                    os.utime(path, ns=(now, now))
                    mapped = pa.memory_map(path) if want_map else None
                except FileNotFoundError:
                    # Removed by hand between the check and the open (eviction waits for the lock).
                    log.debug("cached copy of %s vanished; fetching it again", where)
                    continue
            if self._over:
                # A trim found copies in use and could not get under budget: try again now.
                self._over = not self._make_room(0, keep="")
            return mapped
        raise DataError(f"{where}: its cached copy at {self.data_path(rel)} keeps vanishing")

    def _read_meta(self, rel: str) -> dict[str, Any] | None:
        try:
            with open(self.meta_path(rel)) as f:
                meta = json.load(f)
            return meta if isinstance(meta, dict) else None
        except (OSError, ValueError):
            return None

    def _good(self, rel: str, remote: RemoteStat) -> bool:
        """Whether the copy is there, whole, unchanged remotely and (once per process) checksummed."""
        meta = self._read_meta(rel)
        if meta is None:
            return False
        if meta.get("size") != remote.size or (remote.mtime_ns is not None and meta.get("mtime_ns") != remote.mtime_ns):
            log.info("%s changed remotely (size %s -> %s); fetching it again", self.store.where(rel), meta.get("size"), remote.size)
            return False
        path = self.data_path(rel)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        if st.st_size != remote.size:
            self._corrupt(rel, f"{st.st_size} bytes, not {remote.size}")
            return False
        checksum = str(meta.get("xxh3_64"))
        key = (rel, st.st_ino, checksum)
        if key not in self._verified:
            actual = _file_checksum(path)
            if actual != checksum:
                self._corrupt(rel, f"xxh3 {actual}, not {checksum} as fetched")
                return False
            with self._lock:
                self._verified.add(key)
        return True

    def _corrupt(self, rel: str, why: str) -> None:
        log.warning("cached copy of %s is corrupt (%s: %s); fetching it again", self.store.where(rel), self.data_path(rel), why)
        self.store.count("cache_disk_corrupt")
        for path in (self.meta_path(rel), self.data_path(rel)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    # -- fetching --------------------------------------------------------------------------------
    def _fetch(self, rel: str, remote: RemoteStat) -> None:
        """Copy ``rel`` in, atomically. The caller holds its file lock."""
        where = self.store.where(rel)
        data, meta = self.data_path(rel), self.meta_path(rel)
        folder = os.path.dirname(data)
        os.makedirs(folder, exist_ok=True)
        os.makedirs(os.path.dirname(meta), exist_ok=True)
        self._describe()
        # Temporary files left by a process that died mid-fetch (nobody else holds this lock).
        for stale in glob.glob(glob.escape(data) + ".tmp-*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        if remote.size > self.budget and rel not in self._warned_big:
            self._warned_big.add(rel)
            log.warning("%s (%.1f MB) is bigger than the whole --cache-mb budget (%.1f MB); caching it anyway",
                        where, remote.size / 1e6, self.budget / 1e6)
        self._make_room(remote.size, keep=data)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(meta)  # no sidecar: no one takes the old copy for the new one
        tmp = f"{data}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                out = _Writer(f)
                n = self.store.fetch(rel, out)
                f.flush()
                os.fsync(f.fileno())
            if n != remote.size:
                raise DataError(f"{where}: fetched {n} bytes, but it was listed with {remote.size}")
            os.replace(tmp, data)
            self._write_meta(rel, {
                "uri": where, "rel": rel, "size": remote.size, "mtime_ns": remote.mtime_ns, "etag": None,
                "xxh3_64": out.hash.hexdigest(), "fetched_at": time.time(),
            })
            _fsync_dir(folder)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DataError(f"{where}: no space left in the cache folder {self.base} ({exc})") from None
            raise DataError(f"{where}: cannot write its cached copy in {folder} ({exc})") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        with self._lock:
            self._verified.add((rel, os.stat(data).st_ino, out.hash.hexdigest()))
        self.store.count("remote_fetches")
        self.store.count("remote_bytes", n)
        log.debug("fetched %s (%d bytes) into %s", where, n, data)
        # Fetches that ran side by side each made room for themselves alone: trim what they
        # overshot together.
        self._over = not self._make_room(0, keep=data)

    def _write_meta(self, rel: str, meta: dict[str, Any]) -> None:
        path = self.meta_path(rel)
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path))

    def _describe(self) -> None:
        path = os.path.join(self.dir, "source.txt")
        if not os.path.exists(path):
            os.makedirs(self.dir, exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
            with open(tmp, "w") as f:
                f.write(self.store.uri + "\n")
            os.replace(tmp, path)

    # -- eviction --------------------------------------------------------------------------------
    def _entries(self) -> list[tuple[int, int, str, str, str]]:
        """Every copy in the cache directory: (mtime_ns, size, data, sidecar, lock)."""
        out = []
        for meta in glob.iglob(os.path.join(glob.escape(self.base), "*", "meta", "**", "*.json"), recursive=True):
            folder, rest = meta.split(os.sep + "meta" + os.sep, 1)
            name = rest[: -len(".json")]
            data = os.path.join(folder, "data", name)
            try:
                st = os.stat(data)
            except FileNotFoundError:
                continue
            out.append((st.st_mtime_ns, st.st_size, data, meta, os.path.join(folder, "locks", name + ".lock")))
        return out

    def _make_room(self, need: int, keep: str) -> bool:
        """Evict the least recently used copies (but ``keep``) until ``need`` more bytes fit in
        the budget; False if they do not, copies in use being kept."""
        with _flock(os.path.join(self.base, EVICT_LOCK), f"--cache-dir {self.base}"):
            entries = sorted(e for e in self._entries() if e[2] != keep)
            total = sum(e[1] for e in entries)
            for _, size, data, meta, lock in entries:
                if total + need <= self.budget:
                    return True
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # being checked, opened or fetched right now: not the one to drop
                    for path in (meta, data):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(path)
                finally:
                    os.close(fd)
                total -= size
                self.store.count("cache_disk_evictions")
                log.debug("evicted %s from the disk cache", data)
            return total + need <= self.budget
