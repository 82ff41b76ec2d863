"""``fuelline serve --processes N``: N serving processes behind one port.

Why: a serving process prepares every session's batches on threads (its serving loop's, and
those that decode ahead) that share Python's interpreter lock, so it serves from about one core, whatever the host has (docs/sizing.md). With
``--processes N``, N serving processes listen on the same port (``shared_port``) and the kernel
hands each new connection to one of them. Each is a whole ``fuelline serve``: its own source,
caches, worker processes and Unix socket for the clients on its host. A client's session lives in
one of them, and its batches do not depend on which: every process serves the same dataset with
the same options, so positions and fingerprints agree, and a client that reconnects to another
process resumes where it was (its batches prepared again rather than taken from the first
process's memory tier).

This process, the supervisor, serves nothing. It:

* holds the port (bound, not listening), so that it stays theirs while one of them restarts;
* starts each as ``fuelline serve`` with the same arguments and ``--processes 1``, in a session
  of its own (a Ctrl-C in the terminal reaches the supervisor, which passes it on), with a link
  (a Unix socket pair) whose end tells it that the supervisor is gone, however it died: it then
  stops;
* prints ``serving on tcp://HOST:PORT`` once every process serves; one that exits before it
  serves (a bad dataset, a port taken) stops them all, with its own error above in the log;
* gives them a folder (mode 700) where each publishes its Unix socket, so that a client on the
  host is dealt to the processes in turn rather than by the kernel's hash (``local_group``);
* starts again a process that dies (a signal, a crash, the OOM killer), saying which and how; more
  than ``MAX_RESTARTS`` within ``RESTART_WINDOW`` seconds stop everything, exit status 1;
* kills, and so starts again, a process that serves no more while it lives (stopped, deadlocked):
  each process's serving loop says it runs over the same link, at most twice a second, and one silent for
  ``hang_after`` seconds is hung. A hung process still holds its share of the port, and the kernel
  would go on handing it new connections that nobody answers;
* on SIGTERM or SIGINT, passes SIGTERM on, waits for every process to say Bye to its clients and
  exit, and exits 0 if they all did.

With ``--metrics-port``, each process serves its metrics on a loopback port of its own, and the
supervisor serves them all at the port asked for, each sample labelled with its ``process``
(``fuelline.server.serving.metrics_merge``).
"""

from __future__ import annotations

import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any, Sequence

from fuelline.protocol import DataError
from fuelline.protocol.common.endpoints import parse_ready_line, ready_line
from fuelline.server.serving.local_group import process_file
from fuelline.server.serving.local_ipc import default_base
from fuelline.server.serving.shared_port import shared_port_socket
from fuelline.server.workers.supervision import describe_exit

__all__ = ["ServingProcesses", "METRICS_LINE", "parse_metrics_line"]

log = logging.getLogger("fuelline.server")

MAX_RESTARTS = 5  # within RESTART_WINDOW seconds: more is a crash loop, not bad luck
RESTART_WINDOW = 60.0
# A serving loop says it runs at least every 0.5 s (it turns every quarter heartbeat, 0.25 s at most); one not heard for this many
# heartbeats, and at least HANG_MIN seconds, is hung. Its clients gave up on it after three.
HANG_HEARTBEATS = 5
HANG_MIN = 3.0
STOP_TIMEOUT = 20.0  # seconds the processes get to say Bye and exit after SIGTERM

# What a serving process started by a supervisor prints on stdout once its metrics are served.
METRICS_LINE = "metrics on port {port}"
_METRICS = re.compile(r"metrics on port (\d+)$")


def parse_metrics_line(line: str) -> int | None:
    match = _METRICS.match(line.strip())
    return int(match.group(1)) if match else None


@dataclass
class _Child:
    index: int
    process: subprocess.Popen
    pidfd: int
    # The supervisor's end of the link whose end of file stops the process, and on which the
    # process's serving loop says it runs.
    link: socket.socket
    ready: threading.Event = field(default_factory=threading.Event)
    restarted: bool = False  # started again after a death
    metrics_port: int | None = None
    last_heard: float = field(default_factory=time.monotonic)
    link_open: bool = True
    hung: bool = False


class ServingProcesses:
    """Starts and supervises ``count`` serving processes sharing ``host:port``.

    Args:
        argv: the ``fuelline`` command line that asked for them (global options, ``serve``, the
            dataset and its options); each process gets it again with its place among them.
        count: how many processes.
        host, port: where they listen; port 0 picks a free one.
        metrics: whether each serves metrics (on a loopback port of its own, for the supervisor).
        heartbeat: the processes' heartbeat interval (``--heartbeat``), which sets how long a
            process may go unheard before it counts as hung.
    """

    def __init__(self, argv: Sequence[str], count: int, host: str, port: int, metrics: bool = False,
                 heartbeat: float = 1.0) -> None:
        self.argv = list(argv)
        self.count = count
        self.host = host
        self.metrics = metrics
        self.hang_after = max(HANG_MIN, HANG_HEARTBEATS * heartbeat)
        self.restarts = 0
        self._deaths: deque[float] = deque()
        self._children: dict[int, _Child] = {}
        self._stop_r, self._stop_w = os.pipe()
        os.set_blocking(self._stop_w, False)
        self._stopping = False
        try:
            self._port_hold = shared_port_socket(host, port, listen=False, first=True)
        except OSError as exc:
            raise DataError(f"cannot listen on {host}:{port}: {exc}") from None
        self.port = self._port_hold.getsockname()[1]
        # Where the processes tell one another their Unix sockets (``local_group``), mode 700.
        self.group = tempfile.mkdtemp(prefix="fuelline-group-", dir=default_base())
        address = f"[{host}]" if ":" in host else host
        self.endpoint = f"tcp://{address}:{self.port}"

    # -- what the metrics endpoint reads -------------------------------------------------------
    def metrics_ports(self) -> dict[int, int | None]:
        """Each process's metrics port (None while it starts)."""
        return {k: c.metrics_port for k, c in sorted(self._children.items())}

    def pids(self) -> dict[int, int]:
        return {k: c.process.pid for k, c in sorted(self._children.items())}

    # -- starting ------------------------------------------------------------------------------
    def _command(self, index: int, link: int) -> list[str]:
        extra = ["--processes", "1", "--port", str(self.port), "--serving-process", str(index),
                 "--serving-processes", str(self.count),
                 "--supervisor-link", str(link), "--serving-group", self.group]
        if self.metrics:
            extra += ["--metrics-port", "0", "--metrics-host", "127.0.0.1"]
        return [sys.executable, "-m", "fuelline.server.cli", *self.argv, *extra]

    def _spawn(self, index: int, restarted: bool = False) -> _Child:
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(self._command(index, theirs.fileno()), stdout=subprocess.PIPE, text=True,
                                       pass_fds=(theirs.fileno(),), start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        child = _Child(index, process, os.pidfd_open(process.pid), ours, restarted=restarted)
        self._children[index] = child
        threading.Thread(target=self._read_stdout, args=(child, process.stdout), daemon=True,
                         name=f"fuelline-process-{index}-stdout").start()
        log.info("serving process %d started (pid %d)", index, process.pid)
        return child

    def _read_stdout(self, child: _Child, out: IO[str] | None) -> None:
        """The process's ready and metrics lines; anything else it prints is passed on."""
        assert out is not None
        for line in out:
            if parse_ready_line(line) is not None and not child.ready.is_set():
                child.last_heard = time.monotonic()
                child.ready.set()
                if child.restarted:
                    log.info("serving process %d (pid %d) serves again", child.index, child.process.pid)
                self._wake()
            elif (port := parse_metrics_line(line)) is not None:
                child.metrics_port = port
            else:
                sys.stdout.write(line)
                sys.stdout.flush()

    def start(self) -> None:
        """Start every process and return once each serves.

        Raises:
            DataError: a process exited before it served (its error is in the log above it), or
                SIGTERM/SIGINT came first; the others are stopped.
        """
        for index in range(self.count):
            self._spawn(index)
        while not all(c.ready.is_set() for c in self._children.values()):
            dead = self._wait()
            if self._stopping:
                self._stop_all()
                raise DataError("stopped before every serving process served")
            for child in dead:
                self._stop_all()
                when = "while the others started" if child.ready.is_set() else "before it served; its error is above"
                raise DataError(f"serving process {child.index} (pid {child.process.pid}) "
                                f"{describe_exit(child.process.returncode)} {when}")
        log.info("%d serving processes (pids %s) share %s", self.count,
                 ", ".join(str(p) for p in self.pids().values()), self.endpoint)

    # -- running -------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop every process and return from ``run``. Safe from signal handlers and threads."""
        self._stopping = True
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._stop_w, b"x")
        except (BlockingIOError, OSError):
            pass  # full: the supervisor is due to wake anyway

    def _wait(self, timeout: float | None = None) -> list[_Child]:
        """Wait for a process to exit, a wake-up (stop, a process ready) or ``timeout``; returns
        the processes that exited, reaped."""
        fds = {c.pidfd: c for c in self._children.values()}
        links = {c.link.fileno(): c for c in self._children.values() if c.link_open}
        try:
            readable, _, _ = select.select([self._stop_r, *fds, *links], [], [], timeout)
        except InterruptedError:
            readable = []
        if self._stop_r in readable:
            try:
                os.read(self._stop_r, 4096)
            except BlockingIOError:
                pass
        for fd in readable:
            if (heard := links.get(fd)) is not None:
                try:
                    heard.link_open = bool(heard.link.recv(4096, socket.MSG_DONTWAIT))  # (end of file: it exits)
                    heard.last_heard = time.monotonic()
                except BlockingIOError:
                    pass
                except OSError:
                    heard.link_open = False
        dead = []
        for fd in readable:
            child = fds.get(fd)
            if child is not None:
                child.process.wait()
                try:
                    os.unlink(process_file(self.group, child.index))  # (no client is offered its socket)
                except OSError:
                    pass
                os.close(child.pidfd)
                child.link.close()
                del self._children[child.index]
                dead.append(child)
        return dead

    def _kill_hung(self) -> None:
        """Kill every serving process whose serving loop has not been heard for ``hang_after``
        seconds: its death, noticed as any other, starts it again."""
        now = time.monotonic()
        for child in self._children.values():
            silent = now - child.last_heard
            if child.ready.is_set() and not child.hung and silent > self.hang_after:
                log.error("serving process %d (pid %d) has not run its serving loop for %.1f s: it is hung, and "
                          "connections the kernel hands it go unanswered; killing it", child.index,
                          child.process.pid, silent)
                child.hung = True
                child.process.kill()

    def run(self) -> int:
        """Supervise until ``request_stop``; returns the exit status (0: every process stopped
        when told to)."""
        print(ready_line(self.endpoint), flush=True)
        while not self._stopping:
            for child in self._wait(self.hang_after / 4):
                if self._stopping:
                    break
                if not self._restart(child):
                    self._stop_all()
                    return 1
            self._kill_hung()
        return self._stop_all()

    def _restart(self, child: _Child) -> bool:
        """Start a process that died again; False once they die too often."""
        how = describe_exit(child.process.returncode)
        if child.hung:
            how = f"hung, and {how}"
        now = time.monotonic()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > RESTART_WINDOW:
            self._deaths.popleft()
        if len(self._deaths) > MAX_RESTARTS:
            log.error("serving process %d (pid %d) %s: %d deaths within %.0f s; stopping every serving process",
                      child.index, child.process.pid, how, len(self._deaths), RESTART_WINDOW)
            return False
        log.error("serving process %d (pid %d) %s; starting it again (its clients reconnect to the others or to it)",
                  child.index, child.process.pid, how)
        self.restarts += 1
        self._spawn(child.index, restarted=True)
        return True

    def _stop_all(self) -> int:
        """SIGTERM to every process, SIGKILL to any still running after ``STOP_TIMEOUT``; 0 if
        every process exited 0."""
        status = 0
        for child in self._children.values():
            try:
                child.process.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT
        while self._children:
            left = deadline - time.monotonic()
            if left <= 0:
                for child in list(self._children.values()):
                    log.error("serving process %d (pid %d) did not stop within %.0f s of SIGTERM; killing it",
                              child.index, child.process.pid, STOP_TIMEOUT)
                    child.process.kill()
                    child.process.wait()
                    os.close(child.pidfd)
                    child.link.close()
                    del self._children[child.index]
                return 1
            for child in self._wait(left):
                if child.process.returncode != 0:
                    log.error("serving process %d (pid %d) %s while stopping", child.index, child.process.pid,
                              describe_exit(child.process.returncode))
                    status = 1
        return status

    def close(self) -> None:
        """Release the port, the processes' shared folder and the supervisor's pipes (after
        ``run`` or a failed ``start``)."""
        self._port_hold.close()
        shutil.rmtree(self.group, ignore_errors=True)
        for fd in (self._stop_r, self._stop_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> "ServingProcesses":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._children:
            self._stop_all()
        self.close()
