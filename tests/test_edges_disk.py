"""A full disk under ``fuelline convert``, ``synth`` and ``sample``: one line naming the output
folder, the space it needs and the space free, and nothing left behind (the writers are atomic).

The disk is a real one: a small tmpfs mounted for the test, so the writers meet ENOSPC from the
kernel as they would on a full data volume.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from fuelline.protocol import DataError
from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize

CLI = [sys.executable, "-m", "fuelline.server.cli"]
DISK = "1m"  # small enough that each writer below fills it
SIZE = r"\d+(\.\d)? (B|kB|MB|GB)"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted at teardown; skipped where this user may not mount one."""
    point = tmp_path / "small-disk"
    point.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(point)],
                                 capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no mount command to make a small file system with")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield point
    finally:
        unmounted = subprocess.run(["umount", str(point)], capture_output=True, text=True, timeout=30)
        if unmounted.returncode != 0:  # (a file still open there: detach it anyway, and say so)
            subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=30)
            raise AssertionError(f"the small disk could not be unmounted: {unmounted.stderr.strip()}")


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Raw recordings on the ordinary disk whose dataset does not fit the small one."""
    out = tmp_path_factory.mktemp("raw") / "raw"
    synthesize(str(out), 6, 12.0, 3, video_dim=4)
    return out


def assert_one_line_about_space(out: subprocess.CompletedProcess, command: str, target: Path) -> str:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "Errno" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    line = lines[0]
    assert line.startswith(f"fuelline {command}: error: no space left to write"), line
    assert str(target) in line, line
    assert re.search(f"needs (about|more than) {SIZE}", line) and re.search(f"{SIZE} was free there", line), line
    return line


def assert_nothing_left(disk: Path) -> None:
    assert os.listdir(disk) == [], f"left on the disk: {os.listdir(disk)}"


def test_convert_onto_a_full_disk_says_so_in_one_line_and_leaves_nothing(raw: Path, small_disk: Path) -> None:
    target = small_disk / "dataset"
    out = subprocess.run([*CLI, "convert", str(raw), str(target)], capture_output=True, text=True, timeout=120)
    line = assert_one_line_about_space(out, "convert", target)
    # The estimate comes from the input's size: more than the disk holds, less than twice the input.
    raw_bytes = sum(f.stat().st_size for f in raw.rglob("*") if f.is_file())
    needed = float(re.search(r"needs about (\d+\.\d) MB", line).group(1)) * 1e6
    assert 1024 * 1024 < needed < 2 * raw_bytes, line
    assert_nothing_left(small_disk)


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def test_convert_as_a_library_raises_a_data_error_and_gives_the_space_back(raw: Path, small_disk: Path) -> None:
    empty = free_bytes(small_disk)
    with pytest.raises(DataError, match="no space left to write dataset") as info:
        convert(str(raw), str(small_disk / "dataset"), progress=False)
    assert isinstance(info.value.__cause__, OSError)  # (the writer's own error, for whoever wants it)
    assert_nothing_left(small_disk)
    # While the caller still holds the error, no file of the removed folder is held open: the
    # space is free again (and the disk can be unmounted at teardown).
    assert free_bytes(small_disk) == empty


def test_synth_onto_a_full_disk_says_so_in_one_line_and_leaves_nothing(small_disk: Path) -> None:
    target = small_disk / "raw"
    out = subprocess.run([*CLI, "synth", str(target), "--recordings", "6", "--seconds", "12", "--seed", "1",
                          "--video-dim", "4"], capture_output=True, text=True, timeout=120)
    assert_one_line_about_space(out, "synth", target)
    assert_nothing_left(small_disk)


def test_sample_onto_a_full_disk_says_so_in_one_line_and_leaves_nothing(small_disk: Path) -> None:
    target = small_disk / "sample"
    out = subprocess.run([*CLI, "sample", str(target), "--rows", "200000"], capture_output=True, text=True, timeout=120)
    assert_one_line_about_space(out, "sample", target)
    assert_nothing_left(small_disk)
