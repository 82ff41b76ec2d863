"""tests/run.sh, the README's test command: a worker count it cannot use is named, before anything
is installed or run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_worker_count_that_is_not_one_is_named_and_nothing_runs() -> None:
    done = subprocess.run(["bash", str(ROOT / "tests" / "run.sh"), "--collect-only"], capture_output=True, text=True,
                          timeout=30, env={**os.environ, "FUELLINE_TEST_WORKERS": "two"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "FUELLINE_TEST_WORKERS=two: expected a number of worker processes" in done.stderr, done.stderr
    assert "Success" not in done.stdout and "collected" not in done.stdout  # (no lint, no pytest)
