"""Launching the trainer as users do (``torchrun -m fuelline.trainer``) and reading its metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

__all__ = ["lines", "torchrun", "torchrun_args"]


def torchrun_args(endpoint: str, *options: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "fuelline.trainer", "--servers", endpoint, "--width", "8", *options]


def torchrun(endpoint: str, *options: str, nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    result = subprocess.run(torchrun_args(endpoint, *options, nproc=nproc), capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
