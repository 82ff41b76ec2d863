"""Launching the trainer as users do (``torchrun -m fuelline.trainer``) and reading its metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from support.fault_schedule import descendants

__all__ = ["lines", "torchrun", "torchrun_args"]


def torchrun_args(endpoint: str, *options: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "fuelline.trainer", "--servers", endpoint, "--width", "8", *options]


STACKS_WAIT_S = 10.0  # for the ranks of a job past its time to print where their threads are


def torchrun(endpoint: str, *options: str, nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run a job to its end; one still running after ``timeout`` seconds fails the test with
    where every thread of its ranks was (SIGUSR1: the trainer's stack dump), and is killed whole."""
    args = torchrun_args(endpoint, *options, nproc=nproc)
    job = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in descendants(job.pid):
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        try:  # (what the ranks print is collected meanwhile; the job does not end by itself)
            job.communicate(timeout=STACKS_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate(timeout=30)
        # (The ranks may go on logging after their stacks: from the first stack on, where there is one.)
        starts = [i for i in (err.find("Thread 0x"), err.find("Current thread 0x")) if i >= 0]
        shown = err[max(0, min(starts) - 2000):][:14000] if starts else err[-12000:]
        raise AssertionError(f"torchrun still running after {timeout:.0f} s; its ranks' log and stacks:\n{shown}") from None
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
    result = subprocess.CompletedProcess(args, job.returncode, out, err)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
