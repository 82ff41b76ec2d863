"""The mission end to end on a bed of hosts (benchmarks/bed.py): a torchrun job of two nodes of two
ranks each (c10d rendezvous across hosts) trains from two data servers on two other hosts over
rate-limited links (CURVE on, as off loopback it must be), is killed mid-epoch on both nodes, resumes, and every rank has seen exactly
the sample sequence of an uninterrupted job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from benchmarks.bed import Bed, unavailable  # noqa: E402
from fuelline.server.ingest.convert import convert  # noqa: E402
from fuelline.server.ingest.synth import synthesize  # noqa: E402

from support.processes import ServerProcess  # noqa: E402
from support.trainer import lines  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

RATE = "200mbit"
NODES, PER_NODE = 2, 2
JOB_TIMEOUT_S = 240


def _keys(root: Path) -> tuple[Path, Path]:
    """Server and client CURVE keys, made as the README says."""
    keys, ckeys = root / "keys", root / "ckeys"
    for argv in (["keygen", str(keys)], ["keygen", str(ckeys), "--name", "client"]):
        subprocess.run([sys.executable, "-m", "fuelline.server.cli", *argv], check=True, capture_output=True, timeout=60)
    (ckeys / "server.key").write_bytes((keys / "server.key").read_bytes())
    (keys / "authorized").mkdir(exist_ok=True)
    (keys / "authorized" / "client.key").write_bytes((ckeys / "client.key").read_bytes())
    return keys, ckeys


def _torchrun(bed: Bed, node: int, servers: str, run_id: str, *options: str) -> subprocess.Popen:
    host = bed.hosts[node]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc_per_node", str(PER_NODE),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{bed.hosts[0].address}:29400", "--rdzv_id", run_id,
            # All hosts share the machine's name: each node says which address is its own, and
            # whether it holds the rendezvous store (torch decides by matching names otherwise).
            "--local_addr", host.address, "--rdzv_conf", f"is_host={'true' if node == 0 else 'false'}",
            "-m", "fuelline.trainer", "--servers", servers, "--width", "8", *options]
    return subprocess.Popen(host.command(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _finish(jobs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    outputs = []
    for job in jobs:
        out, _ = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
        outputs.append(out)
    assert [j.returncode for j in jobs] == [0] * len(jobs), "\n---\n".join(o[-3000:] for o in outputs)


def _kill(jobs: list[subprocess.Popen]) -> None:
    for job in jobs:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    for job in jobs:
        job.wait(30)


@pytest.mark.timeout(600)
def test_two_nodes_from_two_servers_killed_and_resumed_see_the_sequence_of_an_uninterrupted_job(tmp_path: Path) -> None:
    synthesize(str(tmp_path / "raw"), 16, 20.0, 2, video_dim=8, drop=0.001)
    convert(str(tmp_path / "raw"), str(tmp_path / "data"), progress=False)
    keys, ckeys = _keys(tmp_path)
    with Bed(4, rate=RATE) as bed:
        servers = []
        try:
            for index in (2, 3):
                host = bed.hosts[index]
                argv = [sys.executable, "-m", "fuelline.server.cli", "serve", str(tmp_path / "data"),
                        "--host", host.address, "--port", "5557", "--batch-size", "8", "--seed", "9", "--curve-keys", str(keys)]
                servers.append(ServerProcess(host.command(argv), tmp_path / f"server-{index}.log"))
            endpoints = ",".join(f"{bed.hosts[i].address}:5557" for i in (2, 3))

            whole = tmp_path / "whole"
            _finish([_torchrun(bed, n, endpoints, "whole", "--epochs", "2", "--sample-log", str(whole),
                               "--curve-keys", str(ckeys)) for n in range(NODES)])

            parts, ck = tmp_path / "parts", tmp_path / "ck"
            common = ("--epochs", "2", "--sample-log", str(parts), "--checkpoint-dir", str(ck),
                      "--checkpoint-every", "2", "--curve-keys", str(ckeys))
            jobs = [_torchrun(bed, n, endpoints, "killed", *common) for n in range(NODES)]
            log_last = Path(f"{parts}.rank{NODES * PER_NODE - 1}")
            deadline = time.monotonic() + JOB_TIMEOUT_S
            try:
                # Well into the first epoch, past a checkpoint: then both nodes die at once.
                while not (log_last.exists() and len(lines(log_last)) >= 5 and (ck / "latest.json").exists()):
                    assert all(j.poll() is None for j in jobs), "the job ended before it could be killed"
                    assert time.monotonic() < deadline, "the job made no progress"
                    time.sleep(0.05)  # polling files other processes write; bounded by the deadline
            finally:
                _kill(jobs)
            saved = json.loads((ck / "latest.json").read_text())["step"]
            assert saved >= 2
            _finish([_torchrun(bed, n, endpoints, "resumed", *common, "--resume") for n in range(NODES)])
        finally:
            for server in servers:
                server.terminate()
    for rank in range(NODES * PER_NODE):
        full = [r["ids"] for r in lines(Path(f"{whole}.rank{rank}"))]
        resumed = [r["ids"] for r in lines(Path(f"{parts}.rank{rank}"))]
        assert full and resumed == full, f"rank {rank}"
