"""One job at a time: a checkpoint folder is held by the job that writes it (a second is refused,
naming the holder, until the first ends however it ends), and a rank whose launcher was killed
ends instead of training on beside a resumed job.

Real processes and real files: the holder killed with SIGKILL, the launcher killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

from fuelline.protocol.errors import CheckpointError  # noqa: E402
from fuelline.trainer.checkpoint import Checkpoints  # noqa: E402

from support.processes import wait_until  # noqa: E402

WAIT = 15.0  # seconds a process may take to start, or to end


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_a_second_job_on_a_checkpoint_folder_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first = Checkpoints(str(tmp_path), rank=0, world_size=2)
    try:
        Checkpoints(str(tmp_path), rank=1, world_size=2)  # the same job's other ranks take no lock
        with pytest.raises(CheckpointError, match=rf"in use by pid {os.getpid()} on {socket.gethostname()}"):
            Checkpoints(str(tmp_path), rank=0, world_size=2)
    finally:
        first.close()
    Checkpoints(str(tmp_path), rank=0, world_size=2).close()  # free once the first job is done


def test_a_folder_held_by_a_killed_job_is_free_again(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from fuelline.trainer.checkpoint import Checkpoints
        Checkpoints({str(tmp_path)!r}, rank=0, world_size=1)
        print("held", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=f"pid {holder.pid}"):
            Checkpoints(str(tmp_path), rank=0, world_size=1)
    finally:
        holder.kill()
        holder.wait(WAIT)
    Checkpoints(str(tmp_path), rank=0, world_size=1).close()


def test_a_rank_whose_launcher_is_killed_ends(tmp_path: Path) -> None:
    # The launcher starts the rank in a session of its own, as torchrun does, and is killed: the
    # rank is re-parented, notices, and ends with status 1.
    watching = tmp_path / "watching"
    rank_code = textwrap.dedent(f"""
        import time
        from fuelline.trainer.lifecycle import exit_with_parent
        exit_with_parent(poll_s=0.05)
        open({str(watching)!r}, "w").close()
        time.sleep(120)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys
        rank = subprocess.Popen([sys.executable, "-c", {rank_code!r}], start_new_session=True)
        print(rank.pid, flush=True)
        rank.wait()
    """)], stdout=subprocess.PIPE, text=True)
    rank_pid = None
    try:
        assert launcher.stdout is not None
        rank_pid = int(launcher.stdout.readline())
        wait_until(watching.exists, WAIT, "the rank watches its launcher")
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(WAIT)
        wait_until(lambda: not _alive(rank_pid), WAIT, "the rank ends once its launcher is gone")
    finally:
        if rank_pid is not None and _alive(rank_pid):
            os.kill(rank_pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
