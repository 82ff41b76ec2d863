"""The body of a worker process of ``fuelline.server.workers.pool.WorkerPool``.

A worker unpickles its copy of the source, says it is ready, then answers one ``Task`` at a
time (the messages: ``fuelline.server.workers.messages``). It decodes the unit and writes the
arrays to the task's path (``fuelline.server.workers.handoff``), answering ``Done``. When the file
cannot be written (no hand-off folder: path None; a full /dev/shm; any OSError), the arrays
themselves go through the pipe: ``Inline``; a server short of shared memory is slower, never
failing. A failure is ``Failed``. Each answer carries the source counters' increments since the
last answer.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import replace
from multiprocessing.connection import Connection

from fuelline.protocol import DataError
from fuelline.server.workers import handoff
from fuelline.server.workers.messages import Answer, Done, Failed, Inline, Ready, SetupFailed, Task

__all__ = ["worker_main"]


def _clean_up_after(paths: list, folder: str | None) -> None:
    """The serving process is gone: remove the hand-off files nobody will read, and the pool's
    folder once its lock died with the server. Every worker tries, each after removing its own
    files: one that was still writing a file when another removed the folder's lock (which left
    the folder behind) removes it once that file is gone."""
    for path in paths:
        handoff.unlink(path)
    if folder is not None:
        handoff.remove_if_dead(folder, made=True)


def _watch_parent(parent_pid: int, paths: list, folder: str | None) -> None:
    """Exit when the serving process is gone, even in the middle of a long task."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            _clean_up_after(paths, folder)
            os._exit(0)


# Seconds a worker whose pipe broke waits for its server's exit to finish before it cleans up.
PARENT_EXIT_WAIT = 10.0


def _parent_gone(parent_pid: int, within: float = 2.0) -> bool:
    """Whether the serving process exited, waiting a little: its pipe reads EOF while the kernel
    is still closing its other files, the pool's lock among them, and it is reparented only after."""
    deadline = time.monotonic() + within
    while os.getppid() == parent_pid:
        if time.monotonic() > deadline:
            return False  # alive: its pipe broke some other way, and it removes the folder itself
        time.sleep(0.02)
    return True


def _server_gone(parent_pid: int, paths: list, folder: str | None) -> None:
    """The pipe to the serving process broke (at start-up, between tasks or with a reply): wait for
    its exit to finish (which on a loaded host can take seconds), then remove what is ours."""
    _parent_gone(parent_pid, within=PARENT_EXIT_WAIT)
    _clean_up_after(paths, folder)


def worker_main(index: int, payload: bytes, conn: Connection, parent_pid: int, log_level: int,
                task_timeout: float | None = None, folder: str | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops us
    faulthandler.enable(file=sys.stderr, all_threads=True)
    logging.basicConfig(
        level=log_level, stream=sys.stderr,
        format=f"%(asctime)s %(name)s[worker {index}] %(levelname)s %(message)s",
    )
    # paths[0]: the file of the task being written; paths[1]: the last one handed over.
    paths: list = [None, None]
    try:
        source = pickle.loads(payload)
    except BaseException:
        try:
            conn.send(SetupFailed(traceback.format_exc()))
        except (OSError, EOFError):
            _server_gone(parent_pid, paths, folder)
        return
    threading.Thread(target=_watch_parent, args=(parent_pid, paths, folder), name="parent-watch", daemon=True).start()
    seen = Counter(source.counters)
    try:
        conn.send(Ready())
    except (OSError, EOFError):
        # Killed while this worker was still starting: it has nobody to be ready for.
        _server_gone(parent_pid, paths, folder)
        return
    while True:
        eof = False
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message, eof = None, True  # (None alone: the pool asks us to exit)
        handoff.unlink(paths[1])  # consumed by now, or never will be
        paths[1] = None
        if message is None:
            if eof:
                # The pipe broke: the server died (or dropped this worker). Its exit closes its
                # files, the pool's lock among them, before it is reparented, which on a loaded
                # host can take seconds: wait for that, then remove what is ours. The folder goes
                # only if no live pool holds its lock, so a server that lives keeps it.
                _server_gone(parent_pid, paths, folder)
            return
        task: Task = message
        paths[0] = task.path
        if task_timeout is not None:
            # The watchdog: past the limit, every thread's traceback goes to stderr and the
            # process exits (code 1); the pool sees a death and names the unit.
            faulthandler.dump_traceback_later(task_timeout, exit=True, file=sys.stderr)
        reply: Answer
        try:
            arrays = source.decode_unit(task.split, task.unit, task.columns)
            reply = _hand_over(task.id, task.path, arrays)
            paths[1] = task.path if isinstance(reply, Done) and reply.written else None
        except Exception as exc:
            handoff.unlink(task.path)
            reply = Failed(task.id, isinstance(exc, DataError), str(exc), type(exc).__name__, traceback.format_exc())
        finally:
            if task_timeout is not None:
                faulthandler.cancel_dump_traceback_later()
        paths[0] = None
        now = source.counters.snapshot()
        counts = {k: v - seen[k] for k, v in now.items() if v != seen[k]}
        seen = Counter(now)
        try:
            conn.send(replace(reply, counts=counts))
        except (OSError, EOFError):
            # The server went while this task ran: as when the pipe breaks between tasks (above).
            # (A worker busy when its server is killed comes here, not there; returning at once,
            # it left the pool's folder behind.)
            _server_gone(parent_pid, paths, folder)
            return


def _hand_over(task_id: int, path: str | None, arrays: dict) -> Done | Inline:
    """The answer for decoded ``arrays``: written to ``path``, or, if that fails, the arrays."""
    if path is None:
        why = "no hand-off folder"
    else:
        try:
            layout, size = handoff.write_arrays(path, arrays)
            return Done(task_id, size > 0, layout)
        except OSError as exc:
            why = f"writing {path}: {exc}"
    for name, a in arrays.items():  # (the pipe pickles: refuse what the file would have refused)
        if getattr(a, "dtype", None) is not None and a.dtype.hasobject:
            raise TypeError(f"array {name!r} has dtype {a.dtype}, which holds Python objects")
    return Inline(task_id, arrays, why)
