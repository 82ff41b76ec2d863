"""examples/convert_ray.py: the parts as Ray tasks on a local Ray (loopback), then the finish, make
the dataset a one-part ``fuelline convert`` makes, file for file."""

from __future__ import annotations

import filecmp
import os
import signal
import subprocess
import sys
from pathlib import Path

from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "convert_ray.py"


def files(root: Path) -> list[str]:
    return sorted(str(Path(folder, name).relative_to(root)) for folder, _, names in os.walk(root) for name in names)


def test_parts_as_ray_tasks_make_the_one_part_dataset(tmp_path: Path) -> None:
    synthesize(str(tmp_path / "raw"), 7, 6.0, 8, video_dim=4, drop=0.01)
    options = {"recordings_per_shard": 2, "val_fraction": 0.3, "seed": 3}
    convert(str(tmp_path / "raw"), str(tmp_path / "one"), progress=False, **options)
    # The example starts a local Ray on loopback and shuts it down when it is done; its own
    # session, so that whatever Ray started goes with it if it has to be stopped here.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), str(tmp_path / "raw"), str(tmp_path / "ray"), "--parts", "3", "--zscore",
         "--num-cpus", "2", "--timeout", "120", "--recordings-per-shard", "2", "--val-fraction", "0.3", "--seed", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env,
    )
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 0, err[-3000:]
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("part ")] == \
        ["part 0/3", "part 1/3", "part 2/3"], out
    assert f"wrote {tmp_path / 'ray'}: 7 recordings from 3 parts" in out, out
    assert not (tmp_path / "ray.parts").exists()
    assert files(tmp_path / "ray") == files(tmp_path / "one")
    for f in files(tmp_path / "one"):
        assert filecmp.cmp(tmp_path / "ray" / f, tmp_path / "one" / f, shallow=False), f
