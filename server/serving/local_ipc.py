"""The private folder of a server's Unix socket, and the sweep of folders that dead servers left.

A server that offers local clients a Unix socket (``Server(local_ipc=True)``) keeps it in a folder
of its own (mode 700: only this user's processes reach it), with the shared-memory slabs its local
clients' batches are placed in (``fuelline.server.serving.slabs``). The folder goes in ``$TMPDIR``
where that is set, else in /dev/shm (memory, so slabs there cost no disk), else in the temporary
directory. A server killed with -9 cannot remove that folder, so every start sweeps the folders
whose server is gone, slabs and all.

A live server holds an exclusive ``flock`` on ``server.lock`` in its folder for as long as it runs;
the kernel drops the lock when the process dies, however it dies, so the sweep can tell a live
server from a dead one without trusting process ids (a container restarted after kill -9 gets the
same pid again). Folders of servers that predate the lock are judged by their socket: a connection
refused means nobody listens there any more.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import logging
import os
import shutil
import socket
import stat
import tempfile

from fuelline.protocol.common.memfs import SHM, on_memory_fs, writable_shm

__all__ = ["LocalSocketDir", "sweep_stale_dirs", "PREFIX", "default_base", "on_memory_fs"]

log = logging.getLogger("fuelline.server")

PREFIX = "fuelline-"
SOCKET = "server.sock"
TOKEN = SOCKET + ".token"
LOCK = "server.lock"


def default_base() -> str:
    """Where socket folders go: ``$TMPDIR`` if set, else /dev/shm if this user may write there,
    else the temporary directory."""
    if not os.environ.get("TMPDIR") and writable_shm():
        return SHM
    return tempfile.gettempdir()


class LocalSocketDir:
    """A server's socket folder, locked while the server lives.

    Args:
        base: where to make it; ``default_base()`` by default.
    """

    def __init__(self, base: str | None = None) -> None:
        base = base or default_base()
        sweep_stale_dirs(base)
        self.path = tempfile.mkdtemp(prefix=PREFIX, dir=base)
        # The lock before the socket: the sweep only looks at folders that have a socket or its
        # token, and by then this lock is held.
        self._lock_fd: int | None = os.open(os.path.join(self.path, LOCK), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    @property
    def in_memory(self) -> bool:
        """Whether the folder is on a memory file system (where slabs may go)."""
        return on_memory_fs(self.path)

    @property
    def socket_path(self) -> str:
        return os.path.join(self.path, SOCKET)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # (after the folder is gone: a sweep never sees it unlocked)
            self._lock_fd = None


def _listening(path: str) -> bool:
    """Whether something accepts connections on the Unix socket at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as exc:
        # A full backlog or anything unexpected: assume someone is there.
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        probe.close()
    return True


def _alive(path: str) -> bool:
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDONLY)
    except FileNotFoundError:
        return _listening(os.path.join(path, SOCKET))
    except OSError:
        return True  # unreadable: not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    finally:
        os.close(fd)  # (closing drops a lock this probe may have taken)
    return False


def sweep_stale_dirs(base: str | None = None) -> list[str]:
    """Remove the socket folders of servers that are gone; returns the folders removed.

    Only folders of this user that hold a server socket or its token are considered.
    """
    base = base or default_base()
    removed = []
    for path in glob.glob(os.path.join(glob.escape(base), PREFIX + "*")):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        if not any(os.path.lexists(os.path.join(path, name)) for name in (SOCKET, TOKEN)):
            continue
        if _alive(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    if removed:
        log.info("removed %d socket folder%s left by servers that are gone", len(removed), "" if len(removed) == 1 else "s")
    return removed
