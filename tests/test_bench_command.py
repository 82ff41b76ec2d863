"""``fuelline bench DATASET``: a real server and a real reader on the user's data beside an
in-process read of the same files; the figures it prints, its one-line errors, and the server it
stops whether it finishes or is interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from support.processes import wait_until

CLI = [sys.executable, "-m", "fuelline.server.cli"]
TRAIN_ROWS = 8_000  # the sample_dataset fixture's train split


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _server_of(pid: int) -> int | None:
    """The ``fuelline serve`` child of a bench process, if it has started one."""
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv:
            return child
    return None


def test_bench_reports_served_and_in_process_figures_and_stops_its_server(sample_dataset: Path) -> None:
    out = subprocess.run([*CLI, "bench", str(sample_dataset), "--epochs", "1", "--json", "--batch-size", "500"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    for side in ("served", "in_process"):
        figures = record[side]
        assert figures["rows_per_s"] > 0 and figures["mb_per_s"] > 0 and figures["batches_per_s"] > 0, side
        assert figures["data_wait_ms_per_batch"] > 0, side
        # Both sides read the whole split, in the same batches.
        assert [(r["rows"], r["batches"]) for r in figures["rounds"]] == [(TRAIN_ROWS, TRAIN_ROWS // 500)], side
    assert isinstance(record["served"]["cpu_ms_per_batch"], float) and record["served"]["cpu_ms_per_batch"] >= 0
    assert record["ratio"]["rows_per_s"] > 0
    assert record["server_exit_code"] == 0  # stopped by SIGTERM, cleanly
    assert _gone(record["server_pid"])


def test_the_table_names_every_figure(sample_dataset: Path) -> None:
    out = subprocess.run([*CLI, "bench", str(sample_dataset), "--epochs", "1", "--batch-size", "1000", "--no-shuffle"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for label in ("rows/s", "MB/s", "batches/s", "data wait ms/batch", "CPU ms/batch", "served/in-process"):
        assert label in out.stdout, label


def test_a_bad_dataset_path_fails_with_one_line_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dataset"
    out = subprocess.run([*CLI, "bench", str(missing), "--epochs", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fuelline bench: error:") and str(missing) in lines[0], out.stderr


def test_an_unknown_split_is_named_with_the_splits_there_are(sample_dataset: Path) -> None:
    out = subprocess.run([*CLI, "bench", str(sample_dataset), "--split", "test"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--split 'test'" in lines[0] and "train" in lines[0], out.stderr


def test_ctrl_c_stops_the_server_and_exits_130_with_one_line(sample_dataset: Path) -> None:
    bench = subprocess.Popen([*CLI, "bench", str(sample_dataset), "--epochs", "10000", "--batch-size", "500"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        server: list[int] = []

        def started() -> bool:
            pid = _server_of(bench.pid)
            if pid is not None:
                server.append(pid)
            return bool(server)

        wait_until(started, 30, "bench starts its server")
        # Only the bench process is signalled (a terminal's Ctrl-C would reach the server too): it
        # must stop the server itself.
        bench.send_signal(signal.SIGINT)
        _, err = bench.communicate(timeout=30)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(timeout=10)
    assert bench.returncode == 130, err
    assert err.strip().splitlines()[-1] == "fuelline bench: interrupted", err
    assert _gone(server[0])
