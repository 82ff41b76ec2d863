"""``StagePool``: the threads that run a source's user code (its per-batch stages) off the serving loop.

A serving loop that ran a user's stage itself would be silent for as long as the stage takes: a
stage of 4 s a batch made every client call the server dead, and one client's slow batches held
up every other client. So a source with user stages hands each gathered batch to this pool and
tells the loop to wait for it (``Waiting``); the loop goes on answering, sending and beating.

Design notes:

* **Fair.** Each reader (one client's session, ``owner``) has at most one batch in the stages at a
  time, and the threads take readers in turn. A reader whose stage takes seconds holds one thread,
  never the pool: the others' batches go through the remaining threads, sharing the cores, not
  waiting behind it. One batch at a time also keeps a reader's batches in order for free.
* **Bounded.** At most ``threads`` threads, started as readers need them; a reader's batches that
  wait for their turn are the few of one gather (``BlockReader.GATHER_BYTES``).
* **Threads, not processes.** Stages receive views of decoded data shared by every client and of
  shared memory the client maps; threads take them without a copy. numpy releases the interpreter
  lock in its loops, so a numerical stage runs beside the loop on another core; pure-Python work
  shares the interpreter lock with it (the loop still gets its turns every few milliseconds).
* **Abandoned, never awaited.** The threads are daemon threads: a stage that hangs keeps its
  thread, and the server still stops on SIGTERM, naming the stage it left running (``runs``).
* **Observed.** The time each stage takes is recorded (``entering``/``left``, called by the
  pipeline on the thread running it) for status lines and metrics; ``runs`` says what runs now and
  for how long, so the server can warn about a batch that takes longer than a few heartbeats.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Hashable

from fuelline.protocol.common.threadnames import name_this_thread
from fuelline.server.sources.contract import StageRun

__all__ = ["StagePool"]

log = logging.getLogger("fuelline.server")


class _Job:
    __slots__ = ("owner", "label", "fn", "args", "future", "started", "stage")

    def __init__(self, owner: Hashable, label: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.owner, self.label, self.fn, self.args = owner, label, fn, args
        self.future: Future = Future()
        self.started = 0.0
        self.stage = ""  # the stage running now, as the pipeline says (``entering``)


class StagePool:
    """Args:
        threads: most threads at once (each runs one reader's batch at a time).
    """

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._cond = threading.Condition()
        self._queues: dict[Hashable, deque[_Job]] = {}  # waiting batches, per reader
        self._turns = 0  # batches started so far
        self._served: dict[Hashable, int] = {}  # per reader: the turn its last batch started at
        self._running: dict[int, _Job] = {}  # by thread id
        self._busy: set[Hashable] = set()  # readers with a batch running
        self._started = 0
        self._idle = 0
        self._closed = False
        self._local = threading.local()
        # Per stage: batches it finished and the seconds it took (status lines, metrics).
        self._times: dict[str, list[float]] = {}

    # -- the reader's side (the serving loop) ----------------------------------------------------
    def submit(self, owner: Hashable, label: str, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on a pool thread, after ``owner``'s batches submitted before it;
        ``label`` says which batch it is (in warnings). A closed pool runs nothing: the future is
        cancelled."""
        job = _Job(owner, label, fn, args)
        with self._cond:
            if self._closed:
                job.future.cancel()
                return job.future
            self._queues.setdefault(owner, deque()).append(job)
            if owner in self._busy:
                pass  # (the thread running its batch takes this one next)
            elif self._idle:
                self._idle -= 1  # (taken off the count here, so a second batch wakes another thread)
                self._cond.notify()
            elif self._started < self.threads:
                self._started += 1
                threading.Thread(target=self._work, name="fuelline-stage", daemon=True).start()
        return job.future

    def forget(self, owner: Hashable) -> None:
        """The reader is done (its client left, its epoch ended): its waiting batches are dropped
        (their futures cancelled). One already in a stage runs on, and its result is dropped."""
        with self._cond:
            queue = self._queues.pop(owner, None)
            self._served.pop(owner, None)
        for job in queue or ():
            job.future.cancel()

    # -- what the server watches -------------------------------------------------------------------
    def runs(self) -> list[StageRun]:
        """The batches in a stage now, longest running first."""
        with self._cond:
            jobs = list(self._running.values())
        return sorted((StageRun(j.stage or "?", j.label, j.started) for j in jobs), key=lambda r: r.started)

    def times(self) -> dict[str, tuple[int, float]]:
        """Per stage: the batches it finished and the seconds it took, since the start."""
        with self._cond:
            return {stage: (int(n), seconds) for stage, (n, seconds) in self._times.items()}

    # -- the pipeline's side (on a pool thread) ------------------------------------------------------
    def entering(self, stage: str) -> None:
        """The batch this thread runs is entering ``stage``."""
        job = getattr(self._local, "job", None)
        if job is not None:
            job.stage = stage

    def left(self, stage: str, seconds: float) -> None:
        """``stage`` finished a batch in ``seconds``."""
        with self._cond:
            entry = self._times.setdefault(stage, [0, 0.0])
            entry[0] += 1
            entry[1] += seconds

    # -- lifecycle -----------------------------------------------------------------------------------
    def close(self) -> list[StageRun]:
        """Stop: waiting batches are dropped, idle threads end, and what is in a stage now is left
        to finish or hang on its daemon thread; returned, so the caller can say what it abandoned."""
        with self._cond:
            self._closed = True
            queues, self._queues = list(self._queues.values()), {}
            self._cond.notify_all()
        for queue in queues:
            for job in queue:
                job.future.cancel()
        return self.runs()

    def _next(self) -> _Job | None:
        """The first waiting batch of the reader served longest ago (or never) among those with
        none running. Call with the lock held."""
        ready = [owner for owner in self._queues if owner not in self._busy]
        if not ready:
            return None
        owner = min(ready, key=lambda o: self._served.get(o, -1))
        queue = self._queues[owner]
        job = queue.popleft()
        if not queue:
            del self._queues[owner]
        self._turns += 1
        self._served[owner] = self._turns
        return job

    def _work(self) -> None:
        name_this_thread("fl-stage")
        me = threading.get_ident()
        while True:
            with self._cond:
                job = self._next()
                while job is None and not self._closed:
                    self._idle += 1
                    self._cond.wait()  # (a submit takes it off the idle count as it wakes it)
                    job = self._next()
                if job is None:
                    self._started -= 1
                    return
                if not job.future.set_running_or_notify_cancel():
                    continue
                job.started = time.monotonic()
                self._running[me] = job
                self._busy.add(job.owner)
            self._local.job = job
            try:
                job.future.set_result(job.fn(*job.args))
            except BaseException as exc:  # (to the reader, which raises it where the batch was due)
                job.future.set_exception(exc)
            finally:
                self._local.job = None
                with self._cond:
                    self._running.pop(me, None)
                    self._busy.discard(job.owner)
            job = None  # (nor its batch: a thread waiting for work holds nothing)
