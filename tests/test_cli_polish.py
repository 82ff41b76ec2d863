"""The command line's manners: ``--version``, Ctrl-C in ``fuelline stream``, and a status line
that speaks English and does not repeat itself while nothing happens."""

from __future__ import annotations

import importlib.metadata
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fuelline.client import ServerDataStream

from conftest import wait_until

CLI = [sys.executable, "-m", "fuelline.server.cli"]
STATUS = re.compile(r" INFO (\d+ clients?; [\d.]+ batches/s)")  # the status line's first words


def test_version_prints_the_installed_version() -> None:
    out = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"fuelline {importlib.metadata.version('fuelline')}"


def test_ctrl_c_in_stream_ends_with_one_line_and_130(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    proc = subprocess.Popen([*CLI, "stream", server.endpoint, "--epochs", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        # Interrupted while reading, not while starting: an epoch was reported.
        first = lines.get(timeout=30)
        assert first.startswith("epoch 0: 80 batches"), first
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=20)
        assert proc.stderr is not None
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert rc == 130, stderr
    assert stderr.strip().splitlines() == ["fuelline stream: interrupted"], stderr


def status_lines(text: str) -> list[str]:
    return [m.group(1) for m in STATUS.finditer(text)]


def said_line(start: str, server) -> bool:
    return any(line.startswith(start) for line in status_lines(server.log()))


def test_idle_status_lines_are_not_repeated_and_plurals_agree(sample_dataset: Path, start_serve) -> None:
    interval = 0.05
    server = start_serve(sample_dataset, "--batch-size", "100", "--status-interval", str(interval))
    wait_until(lambda: status_lines(server.log()), 10, "a first status line")
    # Twenty intervals with nothing happening: a line each, before; now only the first.
    idle_from = time.monotonic()
    wait_until(lambda: time.monotonic() - idle_from > 20 * interval, 5, "twenty idle intervals")
    with ServerDataStream(endpoints=[server.endpoint], timeout=10) as one:
        assert len(list(one.get_epoch_iterator())) == 80
        wait_until(lambda: said_line("1 client;", server), 10, "a line with one client")
        with ServerDataStream(endpoints=[server.endpoint], timeout=10) as two:
            next(iter(two.get_epoch_iterator()))
            wait_until(lambda: said_line("2 clients;", server), 10, "a line with two clients")
    wait_until(lambda: status_lines(server.log())[-1] == "0 clients; 0.0 batches/s", 10, "a line after both left")
    left_at = len(status_lines(server.log()))
    idle_from = time.monotonic()
    wait_until(lambda: time.monotonic() - idle_from > 20 * interval, 5, "twenty idle intervals again")
    said = status_lines(server.log())
    idle = "0 clients; 0.0 batches/s"
    assert said[0] == idle and said[1] != idle, said  # one line for the first idle stretch
    assert len(said) == left_at, said[left_at - 1:]  # and none after the last line said all left
    assert not any(line.startswith("1 clients") for line in said), said
