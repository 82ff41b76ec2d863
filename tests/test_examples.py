"""The examples a user copies run as their docstrings say: launched by torchrun against a real
server, they train, checkpoint, and resume where the checkpoint says."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EPOCH = re.compile(r"^epoch (\d+): (\d+) batches, loss (\S+)$", re.M)


def torchrun_example(script: str, *options: str, nproc: int = 2) -> str:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            str(EXAMPLES / script), *options]
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_ddp_own_model_trains_checkpoints_and_resumes_where_it_stopped(
    sample_dataset: Path, start_serve, tmp_path: Path,
) -> None:
    server = start_serve(sample_dataset, "--batch-size", "400")
    per_rank = 8000 // 400 // 2  # the sample dataset's train split, shared by 2 ranks
    common = ("--server", server.endpoint, "--checkpoint", str(tmp_path / "ckpt"))
    # Interrupted 3 batches into its second epoch.
    out = torchrun_example("ddp_own_model.py", *common, "--epochs", "2", "--stop-after", str(per_rank + 3))
    epochs = [(int(e), int(n), float(loss)) for e, n, loss in EPOCH.findall(out)]
    assert [(e, n) for e, n, _ in epochs] == [(0, per_rank), (1, 3)], out
    assert all(math.isfinite(loss) and loss > 0 for *_, loss in epochs), out
    for rank in (0, 1):
        saved = torch.load(tmp_path / "ckpt" / f"rank{rank}.pt", weights_only=True)
        assert {"model", "optimizer", "onebit", "data"} <= set(saved), saved.keys()
        assert (saved["data"]["epoch"], saved["data"]["batches"], saved["data"]["rank"]) == (1, 3, rank)
        assert saved["onebit"]["iter"] > 10  # past the warm-up: the 1-bit exchange ran
    # The resumed run reads the rest of that epoch, not a whole one, then the next in full.
    out = torchrun_example("ddp_own_model.py", *common, "--epochs", "3", "--resume")
    assert f"resumed at epoch 1, after 3 of its {per_rank} batches" in out, out
    assert [(int(e), int(n)) for e, n, _ in EPOCH.findall(out)] == [(1, per_rank - 3), (2, per_rank)], out
    # Saved at the end of an epoch: a resumed run starts the next one.
    out = torchrun_example("ddp_own_model.py", *common, "--epochs", "4", "--resume")
    assert f"resumed at epoch 2, after {per_rank} of its {per_rank} batches" in out, out
    assert [(int(e), int(n)) for e, n, _ in EPOCH.findall(out)] == [(3, per_rank)], out


def test_every_example_line_fits_the_project_line_length() -> None:
    # ruff selects no line-length rule (E501), so it would not say so itself.
    ruff = (EXAMPLES.parent / "ruff.toml").read_text()
    limit = int(re.search(r"^line-length\s*=\s*(\d+)", ruff, re.M).group(1))
    long = [f"{path.name}:{number}" for path in sorted(EXAMPLES.glob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), start=1) if len(line) > limit]
    assert not long, f"lines over {limit} characters: {long}"
