"""``fuelline convert``: raw TSV recordings to a Parquet dataset with a manifest.

Valid data come from ``fuelline synth``; bad input is a small hand-written raw folder with one
defect put in on purpose, so each test knows the file and line the error must name.
"""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fuelline.protocol import DataError
from fuelline.server.ingest import convert as convert_module
from fuelline.server.ingest.convert import assign_splits, convert
from fuelline.server.ingest.rawformat import CHANNELS, RawDataset, RawRecording
from fuelline.server.ingest.synth import synthesize
from fuelline.server.multimodal.manifest import EEG_CHANNELS, EMOTIONS, MODALITIES, Manifest

VIDEO_DIM = 3
HAND_SECONDS = 2.0
# (recording id, emotion); the clocks of R1's eeg and video are off, the rest are identity.
HAND_RECORDINGS = (("R1", "neutral"), ("R2", "happiness"))
HAND_CLOCKS = {("R1", "eeg"): (10.5, 20.0), ("R1", "video"): (-3.25, -15.0)}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fuelline.server.cli", *args], capture_output=True, text=True, timeout=120
    )


def channel_names(modality: str, video_dim: int) -> tuple[str, ...]:
    return CHANNELS.get(modality) or tuple(f"f{i:03d}" for i in range(video_dim))


def write_tsv(path: Path, header: tuple[str, ...], rows: list[tuple]) -> None:
    path.write_text("".join("\t".join(map(str, row)) + "\n" for row in [header, *rows]))


def write_hand_raw(root: Path) -> Path:
    """Two recordings of two seconds, clean timestamps, values with four decimals."""
    rng = np.random.default_rng(7)
    root.mkdir()
    write_tsv(root / "recordings.tsv", ("recording_id", "participant", "video", "emotion", "arousal", "valence"),
              [(rid, i + 1, 3, emotion, "4.5", "6.25") for i, (rid, emotion) in enumerate(HAND_RECORDINGS)])
    write_tsv(root / "clocks.tsv", ("recording_id", "device", "offset_s", "drift_ppm"),
              [(rid, device, offset, drift) for (rid, device), (offset, drift) in HAND_CLOCKS.items()])
    for rid, _ in HAND_RECORDINGS:
        (root / rid).mkdir()
        for modality, rate in MODALITIES.items():
            offset, drift = HAND_CLOCKS.get((rid, modality), (0.0, 0.0))
            n = int(HAND_SECONDS * rate)
            t = offset + (1 + drift * 1e-6) * (0.25 + np.arange(n) / rate)
            names = channel_names(modality, VIDEO_DIM)
            x = rng.normal(0, 20, size=(n, len(names)))
            rows = [(f"{ti:.6f}", *(f"{v:.4f}" for v in xi)) for ti, xi in zip(t, x)]
            write_tsv(root / rid / f"{modality}.tsv", ("timestamp", *names), rows)
    return root


def edit_line(path: Path, line: int, edit: Callable[[list[str]], list[str]]) -> None:
    """Replace 1-based line ``line`` of a TSV by ``edit`` of its fields."""
    lines = path.read_text().split("\n")
    lines[line - 1] = "\t".join(edit(lines[line - 1].split("\t")))
    path.write_text("\n".join(lines))


def set_field(path: Path, line: int, column: int, value: str) -> None:
    edit_line(path, line, lambda f: f[:column] + [value] + f[column + 1:])


def swap_lines(path: Path, a: int, b: int) -> None:
    lines = path.read_text().split("\n")
    lines[a - 1], lines[b - 1] = lines[b - 1], lines[a - 1]
    path.write_text("\n".join(lines))


def read_tsv(path: Path) -> tuple[list[str], np.ndarray]:
    with open(path) as f:
        header = f.readline().rstrip("\n").split("\t")
    return header, np.loadtxt(path, delimiter="\t", skiprows=1, ndmin=2)


def read_clocks(raw: Path) -> dict[tuple[str, str], tuple[float, float]]:
    with open(raw / "clocks.tsv") as f:
        return {(r["recording_id"], r["device"]): (float(r["offset_s"]), float(r["drift_ppm"]))
                for r in csv.DictReader(f, delimiter="\t")}


def read_emotions(raw: Path) -> dict[str, str]:
    with open(raw / "recordings.tsv") as f:
        return {r["recording_id"]: r["emotion"] for r in csv.DictReader(f, delimiter="\t")}


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def read_recording(dataset: Path, placement) -> tuple[np.ndarray, np.ndarray]:
    table = pq.ParquetFile(dataset / placement.file).read_row_group(placement.row_group)
    # Each value of x is one sample's channels as little-endian float32 bytes.
    rows = table.column("x").to_pylist()
    x = np.frombuffer(b"".join(rows), dtype="<f4").reshape(len(rows), -1) if rows else None
    return table.column("t").to_numpy(), x


# -- valid data (from synth) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path, Manifest]:
    base = tmp_path_factory.mktemp("synth")
    raw, dataset = base / "raw", base / "ds"
    synthesize(str(raw), 12, 4.0, seed=3, video_dim=8)
    manifest = convert(str(raw), str(dataset), val_fraction=0.25, seed=1, recordings_per_shard=5, progress=False)
    return raw, dataset, manifest


def test_manifest_describes_modalities_recordings_splits_and_stats(converted) -> None:
    raw, dataset, manifest = converted
    assert manifest == Manifest.load(str(dataset))
    assert {m: (v.rate, v.channels) for m, v in manifest.modalities.items()} == {
        "eeg": (128, EEG_CHANNELS), "ecg": (256, ("ECG_R", "ECG_L")), "gsr": (4, ("GSR",)),
        "video": (30, tuple(f"f{i:03d}" for i in range(8))),
    }
    emotions = read_emotions(raw)
    assert [r.id for r in manifest.recordings] == list(emotions)
    assert {r.id: r.emotion for r in manifest.recordings} == emotions
    assert {r.split for r in manifest.recordings} == {"train", "val"}
    for m, modality in manifest.modalities.items():
        assert len(manifest.stats[m]["mean"]) == len(manifest.stats[m]["std"]) == len(modality.channels)
    for split in manifest.splits:
        expected = {e: sum(1 for r in manifest.split(split) if r.emotion == e) for e in EMOTIONS}
        assert manifest.class_counts(split) == expected
    assert sum(sum(manifest.class_counts(s).values()) for s in manifest.splits) == 12
    assert manifest.source_bytes == folder_bytes(raw)
    assert manifest.dataset_bytes == folder_bytes(dataset)
    assert (manifest.seed, manifest.val_fraction) == (1, 0.25)


def test_placements_are_one_row_group_per_recording_in_shard_order(converted) -> None:
    _, dataset, manifest = converted
    for i, rec in enumerate(manifest.recordings):
        for m, place in rec.modalities.items():
            assert place.file == f"{m}/part-{i // 5:05d}.parquet"
            assert place.grid_file == f"{m}/grid-{i // 5:05d}.arrow"
            assert place.zgrid_file == f"{m}/zgrid-{i // 5:05d}.arrow"
            assert place.row_group == i % 5
    for m in MODALITIES:
        for kind in ("grid", "zgrid"):
            assert sorted(f.name for f in (dataset / m).glob(f"{kind}-*")) == [f"{kind}-0000{i}.arrow" for i in range(3)]
        files = sorted((dataset / m).glob("part-*"))
        assert [f.name for f in files] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
        assert [pq.ParquetFile(f).metadata.num_row_groups for f in files] == [5, 5, 2]
        meta = pq.ParquetFile(files[0]).metadata
        assert meta.row_group(0).column(1).compression == "LZ4"
        assert "BYTE_STREAM_SPLIT" in meta.row_group(0).column(1).encodings
        schema = pq.read_schema(files[0])
        assert str(schema.field("t").type) == "double"
        channels = len(manifest.modalities[m].channels)
        assert schema.field("x").type == pa.binary(4 * channels)
        assert schema.field("x").metadata == {b"fuelline.dtype": b"<f4", b"fuelline.channels": str(channels).encode()}


def test_samples_equal_the_tsv_values_and_times_the_clock_mapping(converted) -> None:
    raw, dataset, manifest = converted
    clocks = read_clocks(raw)
    for rec in manifest.recordings:
        for m, place in rec.modalities.items():
            _, tsv = read_tsv(raw / rec.id / f"{m}.tsv")
            t, x = read_recording(dataset, place)
            offset, drift = clocks.get((rec.id, m), (0.0, 0.0))
            assert place.rows == len(tsv) == len(t)
            assert x.dtype == np.float32
            np.testing.assert_array_equal(x, tsv[:, 1:].astype(np.float32))
            np.testing.assert_allclose(t, (tsv[:, 0] - offset) / (1 + drift * 1e-6), rtol=0, atol=1e-9)
            assert (place.t_first, place.t_last) == (t[0], t[-1])


def test_stats_equal_numpy_over_the_train_split(converted) -> None:
    _, dataset, manifest = converted
    for m in MODALITIES:
        x = np.concatenate([read_recording(dataset, r.modalities[m])[1] for r in manifest.split("train")])
        np.testing.assert_allclose(manifest.stats[m]["mean"], x.astype(np.float64).mean(axis=0), rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(manifest.stats[m]["std"], x.astype(np.float64).std(axis=0), rtol=1e-5)


def test_cli_converts_a_synth_run_and_prints_the_compression_ratio(tmp_path: Path) -> None:
    raw, dataset = tmp_path / "raw", tmp_path / "ds"
    assert cli("synth", str(raw), "--recordings", "3", "--seconds", "3", "--seed", "0").returncode == 0
    result = cli("convert", str(raw), str(dataset), "--val-fraction", "0", "--recordings-per-shard", "2")
    assert result.returncode == 0, result.stderr
    assert re.search(r"compression \d+\.\d:1", result.stdout), result.stdout
    grids = sum(f.stat().st_size for f in dataset.glob("*/*grid-*.arrow"))
    assert f"master grids, raw and z-scored, {grids / 1e6:.1f} MB" in result.stdout, result.stdout
    assert "train 3" in result.stdout and "MB/s" in result.stdout
    manifest = Manifest.load(str(dataset))
    assert manifest.splits == ("train",) and len(manifest.recordings) == 3


# -- splits ------------------------------------------------------------------------------------


def fake_recordings(per_emotion: tuple[int, ...]) -> list[RawRecording]:
    return [RawRecording(f"{e}_{i}", i, 0, e, 5.0, 5.0, line=0) for e, n in zip(EMOTIONS, per_emotion) for i in range(n)]


def test_splits_are_stratified_by_emotion_and_seeded() -> None:
    recordings = fake_recordings((20, 10, 7, 5, 3, 1))
    splits = assign_splits(recordings, 0.2, seed=0)
    for e, n in zip(EMOTIONS, (20, 10, 7, 5, 3, 1)):
        assert sum(splits[r.id] == "val" for r in recordings if r.emotion == e) == round(n * 0.2)
    assert assign_splits(recordings, 0.2, seed=0) == splits
    assert assign_splits(recordings, 0.2, seed=1) != splits
    assert set(assign_splits(recordings, 0.0, seed=0).values()) == {"train"}


def test_splits_assign_whole_recordings(converted) -> None:
    raw, _, manifest = converted
    expected = assign_splits(RawDataset(str(raw)).recordings, 0.25, seed=1)
    assert {r.id: r.split for r in manifest.recordings} == expected
    for rec in manifest.recordings:  # a recording's every device lies in the one split
        assert set(rec.modalities) == set(MODALITIES)


# -- bad input ---------------------------------------------------------------------------------


@pytest.fixture
def hand(tmp_path: Path) -> tuple[Path, Path]:
    """A valid hand-written raw folder and a DATASET path inside an otherwise empty folder."""
    out = tmp_path / "out"
    out.mkdir()
    return write_hand_raw(tmp_path / "raw"), out / "ds"


def assert_nothing_left(dataset: Path) -> None:
    assert not dataset.exists()
    assert list(dataset.parent.iterdir()) == []  # no temporary folder either


def test_hand_written_raw_converts(hand) -> None:
    raw, dataset = hand
    manifest = convert(str(raw), str(dataset), val_fraction=0, progress=False)
    rec = manifest.recordings[0]
    t, _ = read_recording(dataset, rec.modalities["eeg"])
    # R1's eeg clock undone, up to the microseconds the TSV holds
    np.testing.assert_allclose(t, 0.25 + np.arange(256) / 128, rtol=0, atol=1e-6)
    assert rec.modalities["video"].rows == 60 and manifest.modalities["video"].channels == ("f000", "f001", "f002")


# (what to break, file the error names, line it names, words it contains)
BAD_INPUTS = {
    "non-numeric field": (lambda r: set_field(r / "R2/eeg.tsv", 5, 3, "abc"), "R2/eeg.tsv", 5, "'F3' is not a number: 'abc'"),
    "empty field": (lambda r: set_field(r / "R1/gsr.tsv", 4, 1, ""), "R1/gsr.tsv", 4, "'GSR' is not a number"),
    "too few columns": (lambda r: edit_line(r / "R1/ecg.tsv", 7, lambda f: f[:2]), "R1/ecg.tsv", 7, "2 fields, expected 3"),
    "too many columns": (lambda r: edit_line(r / "R2/video.tsv", 30, lambda f: f + ["1.0"]), "R2/video.tsv", 30,
                         "5 fields, expected 4"),
    "timestamps backwards": (lambda r: swap_lines(r / "R2/gsr.tsv", 5, 6), "R2/gsr.tsv", 6, "goes backwards"),
    "non-finite value": (lambda r: set_field(r / "R1/eeg.tsv", 9, 14, "nan"), "R1/eeg.tsv", 9, "'AF4' is not a finite"),
    "unknown emotion": (lambda r: set_field(r / "recordings.tsv", 3, 3, "joy"), "recordings.tsv", 3,
                        "emotion 'joy' is not one of neutral"),
    "bad recording id": (lambda r: set_field(r / "recordings.tsv", 2, 0, "R 1"), "recordings.tsv", 2,
                         "recording_id 'R 1' must match"),
    "duplicate recording id": (lambda r: set_field(r / "recordings.tsv", 3, 0, "R1"), "recordings.tsv", 3,
                               "duplicate recording_id 'R1' (first on line 2)"),
    "non-integer participant": (lambda r: set_field(r / "recordings.tsv", 2, 1, "1.5"), "recordings.tsv", 2,
                                "'participant' is not an integer"),
    "arousal out of range": (lambda r: set_field(r / "recordings.tsv", 3, 4, "12"), "recordings.tsv", 3,
                             "arousal 12.0 is not in 1..9"),
    "duplicate clock row": (lambda r: edit_line(r / "clocks.tsv", 3, lambda f: ["R1", "eeg", "0", "0"]), "clocks.tsv", 3,
                            "duplicate (recording_id, device) ('R1', 'eeg') (first on line 2)"),
    "bad modality header": (lambda r: edit_line(r / "R1/eeg.tsv", 1, lambda f: [("F9" if c == "F3" else c) for c in f]),
                            "R1/eeg.tsv", 1, "bad header"),
    "bad recordings header": (lambda r: edit_line(r / "recordings.tsv", 1, lambda f: f[:-1]), "recordings.tsv", 1,
                              "missing column 'valence'"),
    "unknown device": (lambda r: set_field(r / "clocks.tsv", 3, 1, "emg"), "clocks.tsv", 3, "device 'emg' is not one of"),
    "clock of an unknown recording": (lambda r: set_field(r / "clocks.tsv", 2, 0, "R9"), "clocks.tsv", 2,
                                      "recording_id 'R9' is not in recordings.tsv"),
    "empty modality file": (lambda r: (r / "R2/ecg.tsv").write_text(""), "R2/ecg.tsv", 1, "empty"),
    "header only": (lambda r: (r / "R2/ecg.tsv").write_text("timestamp\tECG_R\tECG_L\n"), "R2/ecg.tsv", 2, "no samples"),
    "video dimension differs": (lambda r: (r / "R2/video.tsv").write_text("timestamp\tf000\n0.5\t1.0\n"),
                                "R2/video.tsv", 1, "1 channels, expected 3"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_file_and_line_and_leaves_nothing(hand, case: str) -> None:
    raw, dataset = hand
    breaks, file, line, words = BAD_INPUTS[case]
    breaks(raw)
    with pytest.raises(DataError) as info:
        convert(str(raw), str(dataset), progress=False)
    message = str(info.value)
    assert message.startswith(f"{raw / file}, line {line}: "), message
    assert words in message
    assert_nothing_left(dataset)


@pytest.mark.parametrize("case", ["non-numeric field", "timestamps backwards", "unknown emotion", "unknown device"])
def test_cli_reports_bad_input_with_exit_status_2(hand, case: str) -> None:
    raw, dataset = hand
    breaks, file, line, _ = BAD_INPUTS[case]
    breaks(raw)
    result = cli("convert", str(raw), str(dataset))
    assert result.returncode == 2
    assert f"fuelline convert: error: {raw / file}, line {line}: " in result.stderr, result.stderr
    assert_nothing_left(dataset)


def test_missing_modality_file_is_named(hand) -> None:
    raw, dataset = hand
    (raw / "R2" / "video.tsv").unlink()
    result = cli("convert", str(raw), str(dataset))
    assert result.returncode == 2
    assert f"{raw / 'R2' / 'video.tsv'}: file is missing" in result.stderr
    assert_nothing_left(dataset)


def test_missing_recording_folder_is_named_with_its_line(hand) -> None:
    raw, dataset = hand
    shutil.rmtree(raw / "R2")
    with pytest.raises(DataError, match=re.escape(f"{raw / 'R2'}: folder of recording 'R2' is missing "
                                                  f"(listed in {raw / 'recordings.tsv'}, line 3)")):
        convert(str(raw), str(dataset), progress=False)
    assert_nothing_left(dataset)


@pytest.mark.parametrize("name", ["recordings.tsv", "clocks.tsv"])
def test_missing_index_file_is_named(hand, name: str) -> None:
    raw, dataset = hand
    (raw / name).unlink()
    with pytest.raises(DataError, match=re.escape(f"{raw / name}: file is missing")):
        convert(str(raw), str(dataset), progress=False)
    assert_nothing_left(dataset)


def test_missing_raw_folder_is_named(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'nowhere'}: no such folder")):
        convert(str(tmp_path / "nowhere"), str(tmp_path / "out" / "ds"), progress=False)
    assert_nothing_left(tmp_path / "out" / "ds")


def test_existing_dataset_is_refused_and_left_untouched(hand) -> None:
    raw, dataset = hand
    dataset.mkdir()
    (dataset / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        convert(str(raw), str(dataset), progress=False)
    result = cli("convert", str(raw), str(dataset))
    assert result.returncode == 2 and "already exists" in result.stderr
    assert sorted(p.name for p in dataset.parent.iterdir()) == ["ds"]
    assert [p.name for p in dataset.iterdir()] == ["keep.txt"] and (dataset / "keep.txt").read_text() == "mine"


def test_interrupt_mid_conversion_leaves_nothing(hand, monkeypatch) -> None:
    raw, dataset = hand
    append = convert_module._Shard.append
    calls = []

    def interrupted(self, signals):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return append(self, signals)

    monkeypatch.setattr(convert_module._Shard, "append", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(str(raw), str(dataset), recordings_per_shard=1, progress=False)
    assert_nothing_left(dataset)


def test_no_train_recording_is_refused(hand) -> None:
    raw, dataset = hand
    with pytest.raises(DataError, match="no recording in the train split"):
        convert(str(raw), str(dataset), val_fraction=0.9, progress=False)
    assert_nothing_left(dataset)
