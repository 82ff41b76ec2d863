"""``fuelline convert --part I/N`` then ``--finish N``: the dataset of a one-part conversion, file for
file and batch for batch; and a finish that names the part missing, incomplete or made otherwise.

Every conversion here is a real ``fuelline`` process (parts side by side, as on several hosts) or
the library call the command makes; the raw recordings come from ``fuelline synth``.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fuelline.protocol import DataError, OptionError
from fuelline.server.ingest.parts import convert_part, finish, part_folder, parts_folder
from fuelline.server.ingest.rawformat import RawDataset
from fuelline.server.ingest.synth import synthesize
from fuelline.server.multimodal.source import WindowSource

# 10 recordings in shards of 3: 4 shards, which 3 parts split 1 + 1 + 2.
RECORDINGS, PER_SHARD, SEED, VAL = 10, 3, 0, 0.3
OPTIONS = ("--recordings-per-shard", str(PER_SHARD), "--val-fraction", str(VAL), "--seed", str(SEED))
KWARGS = {"recordings_per_shard": PER_SHARD, "val_fraction": VAL, "seed": SEED}
SOURCES = ("eeg", "ecg", "gsr", "video", "label", "sample_id", "t_start")
TIMEOUT = 120


def fuelline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fuelline.server.cli", *args], capture_output=True, text=True,
                          timeout=TIMEOUT)


def side_by_side(*commands: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """``fuelline`` commands run at once, as parts on several hosts would."""
    procs = [subprocess.Popen([sys.executable, "-m", "fuelline.server.cli", *c], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in commands]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return results


def files(root: Path) -> list[str]:
    return sorted(str(Path(folder, name).relative_to(root)) for folder, _, names in os.walk(root) for name in names)


def assert_same_files(got: Path, want: Path) -> None:
    assert files(got) == files(want)
    different = [f for f in files(want) if not filecmp.cmp(got / f, want / f, shallow=False)]
    assert not different, f"files that differ from a one-part conversion's: {different}"


def assert_same_batches(got: Path, want: Path) -> None:
    """An epoch of every split, z-scored and raw, array for array."""
    for normalize in ("zscore", "none"):
        a = WindowSource(str(got), normalize=normalize, batch_size=4)
        b = WindowSource(str(want), normalize=normalize, batch_size=4)
        try:
            assert a.manifest.splits == b.manifest.splits == ("train", "val")
            for split in a.manifest.splits:
                batches = 0
                for x, y in zip(a.iter_batches(split, 0, 0, 1, 0, SOURCES), b.iter_batches(split, 0, 0, 1, 0, SOURCES),
                                strict=True):
                    for key in SOURCES:
                        assert x[key].dtype == y[key].dtype, (normalize, split, key)
                        np.testing.assert_array_equal(x[key], y[key], err_msg=f"{normalize} {split} {key}")
                    batches += 1
                assert batches >= 2, (split, batches)
        finally:
            a.close()
            b.close()


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("parts") / "raw"
    synthesize(str(root), RECORDINGS, 8.0, 4, video_dim=4, drop=0.01, jitter_ms=0.3)
    return root


@pytest.fixture(scope="module")
def one_part(raw: Path) -> Path:
    """The dataset ``fuelline convert RAW DATASET`` writes, as it always has."""
    out = raw.parent / "one"
    result = fuelline("convert", str(raw), str(out), *OPTIONS)
    assert result.returncode == 0, result.stderr
    return out


def test_three_parts_make_the_one_part_dataset_file_for_file_and_batch_for_batch(raw: Path, one_part: Path,
                                                                                 tmp_path: Path) -> None:
    dataset = tmp_path / "three"
    parts = [("convert", str(raw), str(dataset), "--part", f"{i}/3", *OPTIONS) for i in range(3)]
    for code, out, err in side_by_side(*parts):
        assert code == 0, err
        assert out.startswith("wrote part ") and "MB/s" in out, out
    # Part 1 writes its own z-scored grids; the finish writes those of parts 0 and 2.
    zscored = fuelline("convert", str(raw), str(dataset), "--zscore-part", "1/3", *OPTIONS)
    assert zscored.returncode == 0 and "z-scored grids of part 1/3" in zscored.stdout, zscored.stderr
    assert list((Path(part_folder(str(dataset), 1, 3)) / "eeg").glob("zgrid-*.arrow"))
    assert not list((Path(part_folder(str(dataset), 0, 3)) / "eeg").glob("zgrid-*.arrow"))
    done = fuelline("convert", str(raw), str(dataset), "--finish", "3", *OPTIONS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {dataset}: {RECORDINGS} recordings") and "made of 3 parts" in done.stdout
    assert not os.path.exists(parts_folder(str(dataset)))
    assert_same_files(dataset, one_part)
    assert_same_batches(dataset, one_part)


def test_one_part_through_part_and_finish_is_the_one_part_dataset(raw: Path, one_part: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "one"
    record = convert_part(str(raw), str(dataset), 0, 1, progress=False, **KWARGS)
    assert record["recordings"] == [0, RECORDINGS] and record["shards"] == [0, 4]
    finish(str(raw), str(dataset), 1, **KWARGS)
    assert_same_files(dataset, one_part)
    assert_same_batches(dataset, one_part)


def test_more_parts_than_shards_leave_some_parts_empty(raw: Path, one_part: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "six"
    records = [convert_part(str(raw), str(dataset), i, 6, progress=False, **KWARGS) for i in range(6)]
    assert [r["shards"] for r in records] == [[0, 0], [0, 1], [1, 2], [2, 2], [2, 3], [3, 4]]
    assert [len(r["entries"]) for r in records] == [0, 3, 3, 0, 3, 1]
    finish(str(raw), str(dataset), 6, **KWARGS)
    assert_same_files(dataset, one_part)


def test_finish_names_the_missing_part_and_writes_nothing(raw: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "data"
    for i in (0, 2):
        convert_part(str(raw), str(dataset), i, 3, progress=False, **KWARGS)
    convert_part(str(raw), str(dataset), 0, 4, progress=False, **KWARGS)  # (a part of another split)
    result = fuelline("convert", str(raw), str(dataset), "--finish", "3", *OPTIONS)
    assert result.returncode == 2
    message = result.stderr.strip()
    assert "\n" not in message, message
    assert f"part 1/3 ({part_folder(str(dataset), 1, 3)}) is missing" in message, message
    assert "--part 1/3" in message and "holds parts of 4" in message, message
    assert not dataset.exists()
    assert sorted(os.listdir(parts_folder(str(dataset)))) == ["part-0-of-3", "part-0-of-4", "part-2-of-3"]


def test_finish_refuses_a_part_made_from_other_recordings_or_options(raw: Path, tmp_path: Path) -> None:
    other_raw = tmp_path / "other-raw"
    synthesize(str(other_raw), RECORDINGS, 8.0, 5, video_dim=4, drop=0.01, jitter_ms=0.3)
    dataset = tmp_path / "data"
    convert_part(str(raw), str(dataset), 0, 3, progress=False, **KWARGS)
    convert_part(str(other_raw), str(dataset), 1, 3, progress=False, **KWARGS)
    convert_part(str(raw), str(dataset), 2, 3, progress=False, **{**KWARGS, "seed": SEED + 1})
    with pytest.raises(DataError, match=r"^part 1/3 \(.*part-1-of-3\) was made from other raw recordings: "
                                        r"its recordings.tsv differs"):
        finish(str(raw), str(dataset), 3, **KWARGS)
    shutil.rmtree(part_folder(str(dataset), 1, 3))
    convert_part(str(raw), str(dataset), 1, 3, progress=False, **KWARGS)
    result = fuelline("convert", str(raw), str(dataset), "--finish", "3", *OPTIONS)
    assert result.returncode == 2 and not dataset.exists()
    assert f"part 2/3 ({part_folder(str(dataset), 2, 3)}) was made with --seed {SEED + 1}, not {SEED}" in result.stderr
    # A part whose files are not all there is incomplete, and named so.
    shutil.rmtree(part_folder(str(dataset), 2, 3))
    convert_part(str(raw), str(dataset), 2, 3, progress=False, **KWARGS)
    os.unlink(Path(part_folder(str(dataset), 2, 3)) / "video" / "grid-00003.arrow")
    with pytest.raises(DataError, match=r"part 2/3 \(.*\) is incomplete: video/grid-00003.arrow is missing"):
        finish(str(raw), str(dataset), 3, **KWARGS)
    assert not dataset.exists()
    # The same part again with other options, where it is already: refused, and left as it is.
    with pytest.raises(DataError, match=r"part 0/3 \(.*\) was made with --recordings-per-shard 3, not 2"):
        convert_part(str(raw), str(dataset), 0, 3, progress=False, **{**KWARGS, "recordings_per_shard": 2})


@pytest.mark.parametrize("value", ["3/3", "-1/3", "1/0", "1", "a/b"])
def test_a_part_out_of_range_is_refused(raw: Path, tmp_path: Path, value: str) -> None:
    result = fuelline("convert", str(raw), str(tmp_path / "data"), f"--part={value}")
    assert result.returncode == 2
    assert "argument --part: must be I/N" in result.stderr, result.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "data.parts").exists()


def test_a_part_out_of_range_is_refused_by_the_library_and_finish_wants_a_part(raw: Path, tmp_path: Path) -> None:
    with pytest.raises(OptionError, match=r"^part must be I/N with 0 <= I < N, got 3/3$"):
        convert_part(str(raw), str(tmp_path / "data"), 3, 3)
    with pytest.raises(OptionError, match=r"^parts must be >= 1, got 0$"):
        finish(str(raw), str(tmp_path / "data"), 0)
    result = fuelline("convert", str(raw), str(tmp_path / "data"), "--finish", "0")
    assert result.returncode == 2 and "argument --finish: must be >= 1" in result.stderr
    result = fuelline("convert", str(raw), str(tmp_path / "data"), "--part", "0/2", "--finish", "2")
    assert result.returncode == 2 and "not allowed with argument" in result.stderr
    assert not os.listdir(tmp_path)


def test_a_failed_part_leaves_nothing_and_is_simply_run_again(raw: Path, one_part: Path, tmp_path: Path) -> None:
    copy = tmp_path / "raw"
    shutil.copytree(raw, copy)
    dataset = tmp_path / "data"
    for i in (0, 2):
        convert_part(str(copy), str(dataset), i, 3, progress=False, **KWARGS)
    # Part 1 holds recordings 3..5; one of its files has a bad field on line 5.
    victim = copy / RawDataset(str(copy)).recordings[4].id / "ecg.tsv"
    good = victim.read_bytes()
    lines = good.split(b"\n")
    fields = lines[4].split(b"\t")
    lines[4] = b"\t".join([fields[0], b"x" * len(fields[1]), *fields[2:]])
    victim.write_bytes(b"\n".join(lines))
    failed = fuelline("convert", str(copy), str(dataset), "--part", "1/3", *OPTIONS)
    assert failed.returncode == 2
    assert f"{victim}, line 5: field 'ECG_R' is not a number" in failed.stderr, failed.stderr
    assert sorted(os.listdir(parts_folder(str(dataset)))) == ["part-0-of-3", "part-2-of-3"]  # nothing, not even hidden
    # What a part killed on its way leaves: a hidden folder, which neither the rerun nor the finish minds.
    leftover = Path(parts_folder(str(dataset))) / ".part-1-of-3.tmp-99999-0badc0de"
    (leftover / "eeg").mkdir(parents=True)
    (leftover / "eeg" / "part-00001.parquet").write_bytes(b"half")
    victim.write_bytes(good)
    rerun = fuelline("convert", str(copy), str(dataset), "--part", "1/3", *OPTIONS)
    assert rerun.returncode == 0 and rerun.stdout.startswith("wrote part 1/3"), rerun.stderr
    again = fuelline("convert", str(copy), str(dataset), "--part", "1/3", *OPTIONS)
    assert again.returncode == 0 and "is already in" in again.stdout, again.stderr
    finish(str(copy), str(dataset), 3, **KWARGS)
    assert not os.path.exists(parts_folder(str(dataset)))
    assert_same_files(dataset, one_part)
