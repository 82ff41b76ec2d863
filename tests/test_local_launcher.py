"""deploy/local/launch.sh: K servers and an N-rank torchrun job, run end to end, and torn down
without orphans when the job ends, fails, or is interrupted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--servers", "2", "--ranks", "2", "--recordings", "16", "--seconds", "20", "--batch-size", "16"]


def groups(output: str) -> list[int]:
    found = [int(g) for g in re.findall(r"process group (\d+)", output)]
    assert found, output
    return found


def gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(400)
def test_two_servers_and_two_ranks_train_and_everything_stops(tmp_path: Path) -> None:
    out = subprocess.run(["bash", str(ROOT / "deploy/local/launch.sh"), *SMALL, "--epochs", "2",
                          "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=360)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(re.findall(r"^epoch \d/2  loss \d+\.\d+  val acc ", out.stdout, re.M)) == 2
    assert re.search(r"^data servers: 127\.0\.0\.1:\d+, 127\.0\.0\.1:\d+$", out.stdout, re.M)
    assert "stopped: server 0 (exit 0), server 1 (exit 0), trainer (exit 0)" in out.stdout
    assert len(groups(out.stdout)) == 3 and all(gone(g) for g in groups(out.stdout))
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.timeout(300)
def test_a_failing_trainer_stops_the_servers(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "deploy/local/launch.py"), *SMALL, "--workdir", str(tmp_path),
                          "--", "--no-such-option"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 1
    assert "the trainer failed" in out.stderr and "--no-such-option" in out.stderr
    assert all(gone(g) for g in groups(out.stdout))


@pytest.mark.timeout(300)
def test_ctrl_c_mid_training_leaves_no_process_behind(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, str(ROOT / "deploy/local/launch.py"), *SMALL, "--epochs", "50",
                             "--workdir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends at the latest when the launcher exits (and the timeout marks fail it)
            seen.append(line)
            if line.startswith("epoch 1/"):  # the ranks are training
                break
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(seen) + rest
    assert proc.returncode == 128 + signal.SIGINT, output + err
    assert "interrupted (SIGINT)" in err
    pgids = groups(output)
    assert len(pgids) == 3 and all(gone(g) for g in pgids), output
