"""The trainer starts and exits cleanly, launch after launch, on a loaded machine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from fuelline.server.ingest.convert import convert  # noqa: E402
from fuelline.server.ingest.synth import synthesize  # noqa: E402

from support.trainer import lines, torchrun_args  # noqa: E402

ABORT = "terminate called"
# One launch over one connection and one over two. The abort this guards against never reproduced
# here, in 50 launches on the code before its fix; two more launches cost the suite 17 s of 2 cores
# for a failure that 50 did not show.
LAUNCHES = 2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trainer-exit")
    synthesize(str(root / "raw"), 16, 20.0, 2, video_dim=8, drop=0.001)
    convert(str(root / "raw"), str(root / "data"), progress=False)
    return root / "data"


@pytest.mark.timeout(300)
def test_repeated_launches_under_load_never_abort(dataset: Path, start_serve, tmp_path: Path) -> None:
    server = start_serve(dataset, "--batch-size", "8")
    # A process burning a core beside the two ranks: start-up and exit then interleave with the
    # gloo threads the way they do on a busy machine.
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    failures = []
    try:
        for launch in range(LAUNCHES):
            log, ck = tmp_path / f"ids{launch}", tmp_path / f"ck{launch}"
            # Every other launch reads over two connections to the server (--connections).
            connections = ("--connections", "2") if launch % 2 else ()
            result = subprocess.run(torchrun_args(server.endpoint, "--epochs", "1", "--max-steps", "3",
                                                  "--sample-log", str(log), "--checkpoint-dir", str(ck), *connections),
                                    capture_output=True, text=True, timeout=120)
            if result.returncode != 0 or ABORT in result.stderr:
                failures.append((launch, result.returncode, result.stderr[-1500:]))
                continue
            for rank in range(2):  # each step logged once: nothing ran twice
                assert [r["step"] for r in lines(Path(f"{log}.rank{rank}"))] == [1, 2, 3]
            assert json.loads((ck / "latest.json").read_text())["step"] == 3
    finally:
        burner.kill()
        burner.wait(10)
    assert not failures, f"{len(failures)} of {LAUNCHES} launches failed: {failures}"
    # Two ranks over two connections each are four sessions of a world of 4, the last being rank 3.
    assert re.search(r"client \S+: rank 3 of 4, split 'train'", server.log())
