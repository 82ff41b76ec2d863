"""``fuelline synth``: the raw format exactly, the clocks, jitter, drops, the probe, and the CLI."""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fuelline.server.cli import ingest as ingest_cli
from fuelline.server.ingest import synth
from fuelline.server.ingest.synth import EMOTION_PROBABILITIES, synthesize
from fuelline.server.multimodal.manifest import EEG_CHANNELS, EMOTIONS, MODALITIES

SECONDS = 20.0
JITTER_MS = 0.3
RECORDINGS_HEADER = ["recording_id", "participant", "video", "emotion", "arousal", "valence"]
CLOCKS_HEADER = ["recording_id", "device", "offset_s", "drift_ppm"]


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def read_tsv(path: Path) -> tuple[list[str], np.ndarray]:
    """(header, values as a (rows, columns) float array)."""
    with open(path, encoding="utf-8", newline="") as f:
        header = f.readline().rstrip("\n").split("\t")
    return header, np.loadtxt(path, delimiter="\t", skiprows=1, ndmin=2)


def read_clocks(root: Path) -> dict[tuple[str, str], tuple[float, float]]:
    return {(r["recording_id"], r["device"]): (float(r["offset_s"]), float(r["drift_ppm"]))
            for r in read_rows(root / "clocks.tsv")}


def to_master(t_dev: np.ndarray, clock: tuple[float, float]) -> np.ndarray:
    offset, drift_ppm = clock
    return (t_dev - offset) / (1 + drift_ppm * 1e-6)


def device_files(root: Path):
    """(recording id, modality, header, values, clock) for every modality file."""
    clocks = read_clocks(root)
    for rec in read_rows(root / "recordings.tsv"):
        for modality in MODALITIES:
            header, values = read_tsv(root / rec["recording_id"] / f"{modality}.tsv")
            yield rec["recording_id"], modality, header, values, clocks[rec["recording_id"], modality]


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> Path:
    """Four 20 s recordings with the probe on and drops frequent enough to see runs."""
    out = tmp_path_factory.mktemp("synth") / "probed"
    synthesize(str(out), 4, SECONDS, 3, video_dim=4, drop=0.05, jitter_ms=JITTER_MS, probe=True)
    return out


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "many"
    synthesize(str(out), 400, 2.0, 0, video_dim=2)
    return out


def all_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- determinism ---------------------------------------------------------------------------------
def test_same_seed_writes_byte_identical_files(tmp_path):
    synthesize(str(tmp_path / "a"), 3, 3.0, 7, video_dim=3)
    synthesize(str(tmp_path / "b"), 3, 3.0, 7, video_dim=3)
    a, b = all_bytes(tmp_path / "a"), all_bytes(tmp_path / "b")
    assert len(a) == 2 + 3 * len(MODALITIES)
    assert a == b


def test_another_seed_writes_different_files(tmp_path):
    synthesize(str(tmp_path / "a"), 3, 3.0, 7, video_dim=3)
    synthesize(str(tmp_path / "b"), 3, 3.0, 8, video_dim=3)
    a, b = all_bytes(tmp_path / "a"), all_bytes(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(a[name] != b[name] for name in a if name.endswith(".tsv") and "/" in name)


# -- the format ----------------------------------------------------------------------------------
def test_files_have_the_raw_format_headers_and_line_ends(tmp_path):
    root = tmp_path / "raw"
    synthesize(str(root), 2, 2.0, 0, video_dim=5)
    expected = {
        "eeg": list(EEG_CHANNELS), "ecg": ["ECG_R", "ECG_L"], "gsr": ["GSR"],
        "video": ["f000", "f001", "f002", "f003", "f004"],
    }
    files = {root / "recordings.tsv": RECORDINGS_HEADER, root / "clocks.tsv": CLOCKS_HEADER}
    recs = read_rows(root / "recordings.tsv")
    for rec in recs:
        assert (root / rec["recording_id"]).is_dir()
        files.update({root / rec["recording_id"] / f"{m}.tsv": ["timestamp"] + expected[m] for m in MODALITIES})
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted(r["recording_id"] for r in recs)
    for path, header in files.items():
        text = path.read_bytes().decode("utf-8")
        assert "\r" not in text and text.endswith("\n"), path
        lines = text[:-1].split("\n")
        assert lines[0].split("\t") == header, path
        assert len(lines) > 1 and all(len(line.split("\t")) == len(header) for line in lines), path


def test_recordings_and_clocks_have_one_row_per_recording_and_device(tmp_path):
    root = tmp_path / "raw"
    summary = synthesize(str(root), 20, 1.0, 1, video_dim=2)
    recs = read_rows(root / "recordings.tsv")
    assert len(recs) == summary["recordings"] == 20
    assert len({r["recording_id"] for r in recs}) == 20
    assert all(r["recording_id"] == f"P{int(r['participant']):02d}_V{int(r['video']):02d}" for r in recs)
    assert all(r["emotion"] in EMOTIONS for r in recs)
    assert all(1 <= float(r["arousal"]) <= 9 and 1 <= float(r["valence"]) <= 9 for r in recs)
    assert sorted(read_clocks(root)) == sorted((r["recording_id"], m) for r in recs for m in MODALITIES)


def test_summary_counts_what_was_written(tmp_path):
    root = tmp_path / "raw"
    summary = synthesize(str(root), 7, 2.0, 2, video_dim=3)
    rows = {m: sum(len(values) for _, mod, _, values, _ in device_files(root) if mod == m) for m in MODALITIES}
    assert summary["rows"] == rows
    emotions = [r["emotion"] for r in read_rows(root / "recordings.tsv")]
    assert summary["emotions"] == {e: emotions.count(e) for e in EMOTIONS}
    assert summary["bytes"] == sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# -- emotions ------------------------------------------------------------------------------------
def test_emotion_skew_matches_the_original(many):
    emotions = [r["emotion"] for r in read_rows(many / "recordings.tsv")]
    shares = np.array([emotions.count(e) for e in EMOTIONS]) / len(emotions)
    np.testing.assert_allclose(shares, EMOTION_PROBABILITIES, atol=0.04)


@pytest.mark.parametrize("seed", range(5))
def test_every_emotion_occurs_from_six_recordings(tmp_path, seed):
    synthesize(str(tmp_path / "raw"), 6, 0.5, seed, video_dim=1)
    assert sorted(r["emotion"] for r in read_rows(tmp_path / "raw" / "recordings.tsv")) == sorted(EMOTIONS)


def test_self_assessments_follow_the_emotion(many):
    recs = read_rows(many / "recordings.tsv")

    def mean(emotion, key):
        return np.mean([float(r[key]) for r in recs if r["emotion"] == emotion])

    assert mean("anger", "arousal") > mean("neutral", "arousal") + 2
    assert mean("happiness", "valence") > mean("neutral", "valence") > mean("sadness", "valence") + 1


def test_heart_rate_follows_the_emotion(many):
    """Anger and surprise raise the heart rate over neutral and sadness (R peaks cross 0.6 mV)."""
    emotion = {r["recording_id"]: r["emotion"] for r in read_rows(many / "recordings.tsv")}
    bpm = {e: [] for e in EMOTIONS}
    for rec_id, modality, _, values, clock in device_files(many):
        if modality == "ecg":
            t, r = to_master(values[:, 0], clock), values[:, 1]
            beats = np.flatnonzero((r[1:] > 0.6) & (r[:-1] <= 0.6))
            if len(beats) >= 2:
                bpm[emotion[rec_id]].append(60 * (len(beats) - 1) / (t[beats[-1]] - t[beats[0]]))
    fast = min(np.mean(bpm["anger"]), np.mean(bpm["surprise"]))
    assert fast > max(np.mean(bpm["neutral"]), np.mean(bpm["sadness"])) + 5


# -- clocks, jitter, coverage --------------------------------------------------------------------
def test_timestamps_never_go_backwards_even_with_large_jitter(tmp_path):
    # 1.5 ms of jitter is more than half an ECG period at 3 std: the clipping must hold.
    synthesize(str(tmp_path / "raw"), 2, 5.0, 4, video_dim=2, jitter_ms=1.5)
    for rec_id, modality, _, values, _ in device_files(tmp_path / "raw"):
        assert np.all(np.diff(values[:, 0]) > 0), (rec_id, modality)


def test_probed_timestamps_are_increasing(probed):
    for rec_id, modality, _, values, _ in device_files(probed):
        assert np.all(np.diff(values[:, 0]) > 0), (rec_id, modality)


def test_clock_offsets_and_drifts_are_within_range(many):
    clocks = np.array(list(read_clocks(many).values()))
    assert np.all(np.abs(clocks[:, 0]) <= 600) and np.all(np.abs(clocks[:, 1]) <= 80)
    # They really spread over the range: hundreds of seconds, tens of ppm.
    assert np.ptp(clocks[:, 0]) > 1000 and np.ptp(clocks[:, 1]) > 140


def test_devices_start_and_stop_at_different_master_times(probed):
    firsts, lasts = {}, {}
    for rec_id, _modality, _, values, clock in device_files(probed):
        t = to_master(values[:, 0], clock)
        firsts.setdefault(rec_id, []).append(t[0])
        lasts.setdefault(rec_id, []).append(t[-1])
    for rec_id in firsts:
        assert len(set(np.round(firsts[rec_id], 4))) == len(MODALITIES), rec_id
        assert len(set(np.round(lasts[rec_id], 4))) == len(MODALITIES), rec_id
        assert np.ptp(firsts[rec_id]) > 0.01 and np.ptp(lasts[rec_id]) > 0.01


def test_mapped_timestamps_lie_within_the_recording(probed):
    tol = 3 * JITTER_MS * 1e-3 + 1e-5
    for rec_id, modality, _, values, clock in device_files(probed):
        t = to_master(values[:, 0], clock)
        assert -tol <= t[0] <= 1.5 + tol, (rec_id, modality)
        assert SECONDS - 1.5 - 1 / MODALITIES[modality] - tol <= t[-1] <= SECONDS + tol, (rec_id, modality)


@pytest.mark.parametrize("modality", list(MODALITIES))
def test_probe_is_the_master_time_of_the_timestamp_within_jitter(probed, modality):
    bound = 3 * JITTER_MS * 1e-3 + 1e-5
    for rec_id, mod, _, values, clock in device_files(probed):
        if mod == modality:
            error = to_master(values[:, 0], clock) - values[:, 1]
            assert np.max(np.abs(error)) <= bound, rec_id
            assert np.std(error) > JITTER_MS * 1e-3 / 2  # the jitter is really there


@pytest.mark.parametrize("modality", list(MODALITIES))
def test_master_period_is_the_nominal_period_drifted(probed, modality):
    rate = MODALITIES[modality]
    for rec_id, mod, _, values, (_offset, drift_ppm) in device_files(probed):
        if mod == modality:
            # Which nominal sample each row is, dropped ones skipped: device clock periods since the first.
            index = np.rint((values[:, 0] - values[0, 0]) * rate)
            period = np.polyfit(index, values[:, 1], 1)[0]
            assert period == pytest.approx(1 / (rate * (1 + drift_ppm * 1e-6)), rel=1e-6), rec_id
            if abs(drift_ppm) > 10:
                assert period != pytest.approx(1 / rate, rel=1e-6), rec_id


# -- drops ---------------------------------------------------------------------------------------
def missing_runs(values: np.ndarray, rate: int) -> np.ndarray:
    """Samples missing between neighbours, as RAW_FORMAT.md counts them."""
    return np.rint(np.diff(values[:, 0]) * rate) - 1


def test_drops_make_gaps_longer_than_two_samples(probed):
    longest = {m: 0 for m in MODALITIES}
    for _, modality, _, values, _ in device_files(probed):
        longest[modality] = max(longest[modality], int(missing_runs(values, MODALITIES[modality]).max()))
    # GSR has too few samples in 20 s to be sure of a run; the others have thousands.
    assert all(longest[m] > 2 for m in ("eeg", "ecg", "video")), longest


def test_no_drops_make_no_gaps(tmp_path):
    synthesize(str(tmp_path / "raw"), 3, 10.0, 5, video_dim=2, drop=0.0)
    for rec_id, modality, _, values, _ in device_files(tmp_path / "raw"):
        assert np.all(missing_runs(values, MODALITIES[modality]) == 0), (rec_id, modality)


# -- atomicity and the command line --------------------------------------------------------------
def test_failure_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(synth, "_write_small", broken)
    with pytest.raises(OSError, match="disk full"):
        synthesize(str(tmp_path / "raw"), 2, 1.0, 0, video_dim=2)
    assert list(tmp_path.iterdir()) == []


def test_existing_out_is_refused_and_left_untouched(tmp_path):
    out = tmp_path / "raw"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="exists"):
        synthesize(str(out), 1, 1.0, 0)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["raw"]


def fuelline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fuelline.server.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_cli_writes_the_dataset(tmp_path):
    out = tmp_path / "raw"
    proc = fuelline(
        "synth", str(out), "--recordings", "3", "--seconds", "2", "--seed", "1", "--video-dim", "4", "--probe"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out}: 3 recordings") and proc.stdout.count("\n") == 1
    assert len(read_rows(out / "recordings.tsv")) == 3
    assert all(read_tsv(out / r["recording_id"] / "video.tsv")[0] == ["timestamp", "f000", "f001", "f002", "f003"]
               for r in read_rows(out / "recordings.tsv"))


def test_cli_rejects_a_bad_option_by_name(tmp_path):
    proc = fuelline("synth", str(tmp_path / "raw"), "--recordings", "0", "--seconds", "2", "--seed", "1")
    assert proc.returncode != 0
    assert "--recordings" in proc.stderr
    assert not (tmp_path / "raw").exists()


def test_cli_refuses_an_existing_out(tmp_path):
    out = tmp_path / "raw"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = fuelline("synth", str(out), "--recordings", "1", "--seconds", "1", "--seed", "0")
    assert proc.returncode != 0
    assert "exists" in proc.stderr and str(out) in proc.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize(
    "option, value",
    [("--recordings", "0"), ("--recordings", "x"), ("--seconds", "0"), ("--seconds", "-1"), ("--seconds", "inf"),
     ("--video-dim", "0"), ("--drop", "-0.1"), ("--drop", "0.5"), ("--jitter-ms", "-1")],
)
def test_options_are_validated_by_name(option, value, capsys):
    parser = argparse.ArgumentParser(prog="fuelline")
    ingest_cli.register_synth(parser.add_subparsers(dest="command"))
    args = ["synth", "out", "--recordings", "1", "--seconds", "1", "--seed", "0", option, value]
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(args)
    assert exc.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_good_options_reach_run(tmp_path):
    parser = argparse.ArgumentParser(prog="fuelline")
    ingest_cli.register_synth(parser.add_subparsers(dest="command"))
    args = parser.parse_args([
        "synth", "out", "--recordings", "2", "--seconds", "1.5", "--seed", "9",
        "--video-dim", "3", "--drop", "0", "--jitter-ms", "0.1", "--probe",
    ])
    assert args.func is ingest_cli.run_synth
    assert (args.recordings, args.seconds, args.seed, args.video_dim, args.drop, args.jitter_ms, args.probe) == (
        2, 1.5, 9, 3, 0.0, 0.1, True)


def test_synthesize_rejects_bad_arguments(tmp_path):
    for kwargs in ({"recordings": 0}, {"seconds": 0.0}, {"video_dim": 0}, {"drop": 0.5}, {"jitter_ms": -1.0}):
        call = {"recordings": 1, "seconds": 1.0, "video_dim": 2, **kwargs}
        with pytest.raises(ValueError):
            synthesize(str(tmp_path / "raw"), call.pop("recordings"), call.pop("seconds"), 0, **call)
    assert not (tmp_path / "raw").exists()
