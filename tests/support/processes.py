"""Processes the tests start and watch: data servers (ready once they print their ``serving on``
line, stopped with SIGTERM and then SIGKILL after a deadline), resident memory, and waiting on a
condition with a deadline instead of sleeping."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from fuelline.protocol.common.endpoints import parse_ready_line

__all__ = ["START_DEADLINE", "STOP_DEADLINE", "RssSampler", "ServerProcess", "rss_mb", "wait_until"]

START_DEADLINE = 30.0
STOP_DEADLINE = 10.0  # a server's SIGTERM shutdown takes ~2 s; beyond this it is killed


def rss_mb(pid: int) -> float:
    """Resident memory of a process (VmRSS), in MB."""
    with open(f"/proc/{pid}/status") as f:
        match = re.search(r"VmRSS:\s+(\d+) kB", f.read())
    assert match, f"no VmRSS for pid {pid}"
    return int(match.group(1)) / 1024


class RssSampler(threading.Thread):
    """Samples a process's VmRSS every 20 ms, so a spike between two checks is seen too."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.pid = pid
        self.baseline = self.peak = rss_mb(pid)
        self._stop_event = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._stop_event.wait(0.02):
            try:
                self.peak = max(self.peak, rss_mb(self.pid))
            except (OSError, AssertionError):
                return  # the process is gone; the test says so on its own

    def stop(self) -> float:
        self._stop_event.set()
        self.join(5.0)
        return self.peak


def wait_until(predicate, timeout: float, what: str) -> float:
    """Wait for a condition another thread or process brings about; returns the seconds waited."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.01)
    return time.monotonic() - start


class ServerProcess:
    """A data server in its own process; ``port`` is known once it printed ``serving on``."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env or os.environ.copy()
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.port = self._wait_ready()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def _wait_ready(self) -> int:
        deadline = time.monotonic() + START_DEADLINE
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()}") from None
                continue
            ready = parse_ready_line(line)
            if ready is not None:
                return ready[1]
        self.kill()
        raise RuntimeError(f"server not ready within {START_DEADLINE}s: {self.log()}")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def wait_log(self, pattern: str, timeout: float = 10.0) -> str:
        """Wait until the server's log matches ``pattern``; return the log."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            text = self.log()
            if rx.search(text):
                return text
            time.sleep(0.05)  # polling a file the server appends to; the deadline bounds it
        raise AssertionError(f"server log never matched {pattern!r} within {timeout}s:\n{self.log()}")

    def terminate(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server ignored SIGTERM for {timeout}s") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self, timeout: float = STOP_DEADLINE) -> bool:
        """Stop as an operator would: SIGTERM, then SIGKILL if the server outlives ``timeout``.
        Returns False if it had to be killed (a server that ignores SIGTERM is a bug)."""
        stopped = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                stopped = False
                self.kill()
        self._reader.join(5.0)  # (the pipe ends with the process)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        return stopped
