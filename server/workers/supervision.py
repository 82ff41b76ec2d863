"""How a ``WorkerPool`` starts, replaces and stops its worker processes, and when it gives up.

A worker that dies (a signal, a segfault, ``os._exit``, the OOM killer, or its watchdog after
``task_timeout``) is replaced, and the unit it was on retried once; a unit that kills a worker
twice fails with a DataError naming it, and fails at once from then on. More than
``max_restarts`` restarts within ``restart_window`` seconds break the pool: every pending and
later task fails with ``WorkerPoolBroken`` and the reason, rather than a crash loop spinning.
``fuelline.server.workers.pool`` has the whole design; this is the half that deals with processes,
the other hands tasks out and reads the answers.
"""

from __future__ import annotations

import abc
import logging
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Sequence

from fuelline.protocol import DataError, WorkerError
from fuelline.server.workers import handoff
from fuelline.server.workers.child import worker_main
from fuelline.server.workers.messages import FromWorker

__all__ = ["CRASH_SIGNALS", "WorkerError", "WorkerPoolBroken", "WorkerSupervision", "describe_exit"]

log = logging.getLogger("fuelline.server")


class WorkerPoolBroken(WorkerError):
    """Workers died too often, or could not start: no task can run."""


@dataclass
class _Task:
    id: int
    split: str
    unit: int
    columns: Sequence[Any]
    future: Future
    path: str | None  # where the worker writes the arrays; None: through the pipe
    deaths: int = 0  # workers that died running it
    started: bool = False  # the future is running (set once, before the first hand-out)


@dataclass
class _Worker:
    index: int
    process: Any  # multiprocessing.Process
    conn: Connection
    ready: bool = False
    task: _Task | None = None
    task_started: float = 0.0  # monotonic time the current task was handed over
    pids: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"worker {self.index} (pid {self.process.pid})"


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "closed its pipe"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


CRASH_SIGNALS = {-s for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT)}


def _log_hint(exitcode: int | None, stuck: bool) -> str:
    """Where the log holds more of a dead worker: its traceback after a crash, its threads' stacks
    after its watchdog stopped it."""
    if exitcode in CRASH_SIGNALS:
        return "; its traceback (faulthandler) is above in this log"
    if stuck:
        return "; where its threads were (faulthandler) is above in this log"
    return ""


class WorkerSupervision(abc.ABC):
    """The process side of ``WorkerPool``: spawning workers, handling their deaths, breaking the
    pool, stopping the workers. ``WorkerPool`` sets the state below and provides ``_handle`` (a
    worker's message) and ``_describe`` (a unit, for messages)."""

    STOP_TIMEOUT: float
    source: Any
    task_timeout: float | None
    max_restarts: int
    restart_window: float
    _ctx: Any  # a multiprocessing context
    _payload: bytes  # the pickled source
    _incarnation: handoff.Incarnation | None
    _lock: threading.Lock
    _queue: deque[_Task]
    _workers: list[_Worker]
    _restarts: deque[float]  # when workers were restarted, within restart_window
    _broken: str | None
    _poisoned: dict[tuple[str, int], str]
    _closed: bool

    @abc.abstractmethod
    def _handle(self, w: _Worker, message: FromWorker) -> None:
        ...

    @abc.abstractmethod
    def _describe(self, task: _Task) -> str:
        ...

    def _died(self, w: _Worker) -> None:
        how, stuck = self._reap(w)
        self._read_last_words(w)
        if self._broken is not None:
            return  # (its setup failed: the pool broke, and says why)
        task, w.task = w.task, None
        doing = f"while decoding {self._describe(task)}" if task else ("while idle" if w.ready else "while starting")
        if task is not None:
            handoff.unlink(task.path)
        if self._closed:
            if task is not None:
                _fail(task.future, WorkerError(f"{self._describe(task)}: the worker pool was closed"))
            return  # no replacement for a pool that is closing
        hint = _log_hint(w.process.exitcode, stuck)
        if self._restarted_too_often():
            if task is not None:
                with self._lock:
                    self._queue.appendleft(task)  # failed with the rest, with the reason
            self._break(
                f"{len(self._restarts)} worker restarts within {self.restart_window:.0f}s; the last: "
                f"{w.name} {how} {doing}{hint}"
            )
            return
        log.error("%s %s %s%s; starting a replacement", w.name, how, doing, hint)
        self._workers[w.index] = self._spawn(w.index)
        self.source.counters.add("workers_restarted")
        log.info("worker %d restarted as pid %d", w.index, self._workers[w.index].process.pid)
        if task is not None:
            self._retry_or_poison(task, f"{w.name} {how}")

    def _reap(self, w: _Worker) -> tuple[str, bool]:
        """Wait for a dead worker's process (killed if it lingers): how it ended, in words, and
        whether its watchdog stopped it, stuck on a task."""
        w.process.join(self.STOP_TIMEOUT)  # it is gone or going: its pipe or sentinel fired
        if w.process.exitcode is None:
            w.process.kill()
            w.process.join(self.STOP_TIMEOUT)
        stuck = (w.task is not None and self.task_timeout is not None and w.process.exitcode == 1
                 and time.monotonic() - w.task_started >= self.task_timeout)
        if stuck:
            return f"was stuck for more than {self.task_timeout:g}s and stopped by its watchdog", True
        return describe_exit(w.process.exitcode), False

    def _read_last_words(self, w: _Worker) -> None:
        """What a dead worker sent before it died still counts (a result, or why it could not start)."""
        try:
            while self._broken is None and w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            pass
        w.conn.close()

    def _restarted_too_often(self) -> bool:
        """Count a restart; whether the pool has now restarted more than it may within its window."""
        now = time.monotonic()
        self._restarts.append(now)
        while self._restarts and self._restarts[0] < now - self.restart_window:
            self._restarts.popleft()
        return len(self._restarts) > self.max_restarts

    def _retry_or_poison(self, task: _Task, death: str) -> None:
        """A task whose worker died (``death``: which, and how): tried once more in another worker;
        after a second death, failed, and refused from then on."""
        task.deaths += 1
        if task.deaths >= 2:
            message = (
                f"{self._describe(task)}: a worker process died while decoding it, twice "
                f"(the last: {death}); it is not tried again"
            )
            with self._lock:
                self._poisoned[(task.split, task.unit)] = message
            _fail(task.future, DataError(message))
        else:
            log.warning("retrying %s once, in another worker process", self._describe(task))
            with self._lock:
                self._queue.appendleft(task)

    def _spawn(self, index: int) -> _Worker:
        parent_end, child_end = self._ctx.Pipe(duplex=True)
        level = logging.getLogger().getEffectiveLevel()
        process = self._ctx.Process(
            target=worker_main,
            args=(index, self._payload, child_end, os.getpid(), level, self.task_timeout,
                  self._incarnation.path if self._incarnation is not None else None),
            name=f"fuelline-worker-{index}", daemon=True,
        )
        process.start()
        child_end.close()  # so the worker's death is EOF here
        self.source.counters.add("workers_started")
        return _Worker(index, process, parent_end)

    def _break(self, reason: str) -> None:
        with self._lock:
            if self._broken is not None:
                return
            self._broken = reason
        log.error("worker pool broken, every unit still to decode fails: %s", reason)
        self._stop_workers(WorkerPoolBroken(reason))

    def _stop_workers(self, error: WorkerError) -> None:
        """Ask every worker to exit, then terminate the ones that do not; fail every task."""
        workers = list(self._workers)
        for w in workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + self.STOP_TIMEOUT
        for w in workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
        for w in workers:
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(1.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(1.0)
            w.conn.close()
            if w.task is not None:
                _fail(w.task.future, error)
                w.task = None
        with self._lock:
            queued, self._queue = list(self._queue), deque()
        for task in queued:
            _fail(task.future, error)
        if self._incarnation is not None:
            self._incarnation.clear()


def _fail(future: Future, error: BaseException) -> None:
    try:
        future.set_exception(error)
    except InvalidStateError:
        pass  # cancelled, or already decided
