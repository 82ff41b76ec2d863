"""synth → convert → serve → ServerDataStream: aligned windows checked against the probe truth."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from fuelline.client import ServerDataStream
from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize
from fuelline.server.multimodal.manifest import EMOTIONS, MODALITIES, Manifest
from fuelline.server.multimodal.source import SAMPLE_ID_STRIDE, WindowSource

from support.formats import strip_grids

TIMEOUT = 30.0
SOURCES = ("eeg", "ecg", "gsr", "video", "label", "sample_id", "t_start")
SECONDS = 24.0


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ten recordings whose channel 0 is the true master time; clocks off by up to ±600 s and
    ±80 ppm, jitter 0.3 ms, dropped samples and dropout runs."""
    root = tmp_path_factory.mktemp("windows")
    synthesize(str(root / "raw"), 10, SECONDS, 7, video_dim=6, drop=0.01, jitter_ms=0.3, probe=True)
    convert(str(root / "raw"), str(root / "data"), val_fraction=0.2, seed=0, progress=False)
    return root / "data"


def read_all(endpoint: str, split: str = "train", **kw) -> dict[str, np.ndarray]:
    with ServerDataStream(endpoints=[endpoint], split=split, timeout=TIMEOUT, **kw) as s:
        batches = list(s.get_epoch_iterator(as_dict=True))
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def stored(dataset: Path, manifest: Manifest, rec_index: int, modality: str) -> np.ndarray:
    """The master timestamps convert stored for one recording and modality."""
    p = manifest.recordings[rec_index].modalities[modality]
    return pq.ParquetFile(dataset / p.file).read_row_group(p.row_group, columns=["t"]).column("t").to_numpy()


def test_served_grid_points_are_within_a_millisecond_of_the_truth(probed: Path, start_serve) -> None:
    server = start_serve(probed, "--normalize", "none", "--batch-size", "16")
    w = read_all(server.endpoint)
    grid = lambda rate, n: w["t_start"][:, None] + np.arange(n) / rate  # noqa: E731
    for name in ("eeg", "ecg", "gsr"):
        rate = MODALITIES[name]
        probe = w[name][:, 0, :]  # channel 0, every grid point of every window
        assert probe.shape[1] == int(2.0 * rate)
        assert np.abs(probe - grid(rate, probe.shape[1])).max() < 1e-3, name
    # Video: the frame chosen is the nearest frame that exists, within half a period + 1 ms of
    # each grid point wherever no frame is missing.
    manifest = Manifest.load(str(probed))
    frames = w["video"][:, :, 0]
    g = grid(30, 60)
    checked = 0
    for i, sid in enumerate(w["sample_id"]):
        t = stored(probed, manifest, int(sid // SAMPLE_ID_STRIDE), "video")
        nearest_t = t[np.abs(t[None, :] - g[i][:, None]).argmin(axis=1)]
        # The probe is the true time of the chosen frame; its stamped time is within jitter of it.
        assert np.abs(frames[i] - nearest_t).max() < 1.5e-3
        # Where the frames around a grid point are neighbours (none missing between them):
        j = np.clip(np.searchsorted(t, g[i]), 1, len(t) - 1)
        whole = np.rint((t[j] - t[j - 1]) * 30) == 1
        assert np.abs(frames[i] - g[i])[whole].max(initial=0) <= 0.5 / 30 + 1e-3
        checked += int(whole.sum())
    assert checked > 0.9 * frames.size


def test_labels_ids_and_splits_are_right(probed: Path, start_serve) -> None:
    server = start_serve(probed, "--batch-size", "32")
    manifest = Manifest.load(str(probed))
    for split in ("train", "val"):
        w = read_all(server.endpoint, split=split)
        recs = w["sample_id"] // SAMPLE_ID_STRIDE
        assert len(np.unique(w["sample_id"])) == len(w["sample_id"])  # unique windows
        for rec, label in zip(recs.tolist(), w["label"].tolist()):
            r = manifest.recordings[rec]
            assert r.split == split  # whole recordings per split, never windows of the other
            assert label == EMOTIONS.index(r.emotion)


def test_sample_ids_are_stable_across_epochs_and_restarts(probed: Path, start_serve) -> None:
    a = start_serve(probed, "--seed", "3")
    with ServerDataStream(("sample_id", "t_start"), endpoints=[a.endpoint], timeout=TIMEOUT) as s:
        epochs = [np.concatenate([b[0] for b in s.get_epoch_iterator()]) for _ in range(2)]
        starts = {}
        for b in s.get_epoch_iterator():
            starts.update(zip(b[0].tolist(), b[1].tolist()))
    assert sorted(epochs[0]) == sorted(epochs[1]) and not np.array_equal(epochs[0], epochs[1])
    a.terminate()
    b = start_serve(probed, "--seed", "3")
    again = read_all(b.endpoint)
    assert np.array_equal(again["sample_id"], epochs[0])  # same order after a restart, too
    assert all(starts[i] == t for i, t in zip(again["sample_id"].tolist(), again["t_start"].tolist()))


def test_no_covered_window_is_dropped_and_gaps_are_counted(probed: Path) -> None:
    src = WindowSource(str(probed), normalize="none")
    manifest = src.manifest
    for split in src.splits:
        sp = src._splits[split]
        for (index, rec), v in zip(sp.recordings, sp.windows):
            ts = {m: stored(probed, manifest, index, m) for m in MODALITIES}
            for start, valid, reason in zip(v.starts, v.valid, v.reason):
                needs = {m: (start, start + (int(2.0 * r) - 1) / r) for m, r in MODALITIES.items()}
                covered = all(ts[m][0] <= lo + (0.5 / 30 if m == "video" else 0) and ts[m][-1] >= hi - (0.5 / 30 if m == "video" else 0)
                              for m, (lo, hi) in needs.items())
                gaps = {}
                for m, (lo, hi) in needs.items():
                    t = ts[m]
                    inside = (t[1:] > lo) & (t[:-1] < hi)
                    missing = np.rint(np.diff(t) * MODALITIES[m]) - 1
                    gaps[m] = int(missing[inside].max()) if inside.any() else 0
                should = covered and max(gaps.values()) <= 2
                assert valid == should, (rec.id, start, reason, gaps)
                if not valid:
                    assert reason.endswith("not covered") or reason.endswith("gap > 2")
    dropped = src.dropped("train")
    assert any("gap > 2" in r for r in dropped), "the fixture's dropout runs must show up as counted gaps"


def test_ranks_get_disjoint_windows_and_equal_batch_counts(probed: Path, start_serve) -> None:
    server = start_serve(probed, "--batch-size", "8")
    ids, counts = [], []
    for rank in range(2):
        with ServerDataStream(("sample_id",), endpoints=[server.endpoint], rank=rank, world_size=2, timeout=TIMEOUT) as s:
            batches = [b[0] for b in s.get_epoch_iterator()]
            total = s.info["rows"]
        counts.append(len(batches))
        ids.append(np.concatenate(batches))
    assert counts[0] == counts[1]
    both = np.concatenate(ids)
    assert len(np.unique(both)) == total
    assert len(both) - total == (-total) % 2


def test_welcome_carries_class_counts_and_dropped_reasons(probed: Path, start_serve) -> None:
    server = start_serve(probed)
    with ServerDataStream(endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        info = s.info
        schema = s.schema
    assert sum(info["class_counts"].values()) == info["rows"]
    assert info["dropped"] and all(isinstance(v, int) for v in info["dropped"].values())
    assert schema["eeg"] == {"dtype": "<f4", "shape": [14, 256]}
    assert schema["video"] == {"dtype": "<f4", "shape": [60, 6]}
    assert schema["t_start"] == {"dtype": "<f8", "shape": []}
    assert "dropped" in server.log() or "gap > 2" in server.log()


def test_zscore_normalises_with_train_statistics(probed: Path, start_serve) -> None:
    server = start_serve(probed)
    w = read_all(server.endpoint)
    ecg = w["ecg"][:, 1, :]  # a signal channel (channel 0 is the probe)
    assert abs(float(ecg.mean())) < 0.2 and 0.7 < float(ecg.std()) < 1.3


def test_a_user_stage_runs_on_the_server(probed: Path, start_serve) -> None:
    server = start_serve(probed, "--stage", "fuelline.server.multimodal.stages:band_power")
    with ServerDataStream(("eeg_bands", "label"), endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        bands, label = next(iter(s.get_epoch_iterator()))
        assert s.schema["eeg_bands"] == {"dtype": "<f4", "shape": [14, 4]}
    assert bands.shape[1:] == (14, 4) and np.isfinite(bands).all()


def test_a_bad_stage_is_named(probed: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fuelline.server.cli", "serve", str(probed), "--port", "0", "--stage", "no.such.module:f"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "--stage 'no.such.module:f': cannot import 'no.such.module'" in result.stderr


def test_inspect_reports_windows_and_compression(probed: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fuelline.server.cli", "inspect", str(probed), "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    src = WindowSource(str(probed), normalize="none")
    assert report["splits"]["train"]["windows"] == src.rows("train")
    assert report["splits"]["train"]["dropped_windows"] == src.dropped("train")
    assert report["compression_ratio"] > 1.0


def _rewrite_x(src: Path, dst: Path, make_x) -> None:
    """A copy of a converted dataset whose ``x`` columns are rebuilt by ``make_x(samples)``."""
    import shutil

    import pyarrow as pa

    shutil.copytree(src, dst)
    for path in dst.glob("*/*.parquet"):
        pf = pq.ParquetFile(path)
        tables = []
        for g in range(pf.num_row_groups):
            table = pf.read_row_group(g)
            rows = table.column("x").to_pylist()
            samples = np.frombuffer(b"".join(rows), dtype="<f4").reshape(len(rows), -1)
            tables.append(pa.table({"t": table.column("t"), "x": make_x(samples)}))
        with pq.ParquetWriter(path, tables[0].schema) as w:
            for t in tables:
                w.write_table(t, row_group_size=t.num_rows)


def test_a_format_1_dataset_is_refused_until_upgraded_then_serves_the_same_windows(probed: Path, tmp_path: Path) -> None:
    import pyarrow as pa

    from fuelline.protocol import DataError

    old = tmp_path / "format1"
    _rewrite_x(probed, old, lambda s: pa.FixedSizeListArray.from_arrays(pa.array(s.reshape(-1)), s.shape[1]))
    strip_grids(old, "fuelline-multimodal/1")
    with pytest.raises(DataError, match=rf"format 'fuelline-multimodal/1' predates .*`fuelline upgrade {old}`"):
        WindowSource(str(old))
    done = subprocess.run([sys.executable, "-m", "fuelline.server.cli", "upgrade", str(old)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "from fuelline-multimodal/1 to fuelline-multimodal/3" in done.stdout
    new_src, old_src = WindowSource(str(probed), seed=3), WindowSource(str(old), seed=3)
    a, b = (list(src.iter_batches("train", 0, 0, 1, 0, SOURCES)) for src in (new_src, old_src))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_an_x_column_of_the_wrong_width_is_named(probed: Path, tmp_path: Path) -> None:
    import pyarrow as pa

    from fuelline.protocol import DataError

    bad = tmp_path / "narrow"
    # Every sample one channel short: plausible bytes, wrong shape.
    _rewrite_x(probed, bad, lambda s: pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(4 * (s.shape[1] - 1) or 4), len(s), [None, pa.py_buffer(np.ascontiguousarray(s[:, :-1] if s.shape[1] > 1 else s).tobytes())]))
    with pytest.raises(DataError, match=r"shard .*part-00000\.parquet, row group \d+ \(recording .*\): column x is fixed_size_binary"):
        # (a hop that is no whole number of EEG periods: those windows are resampled from x)
        list(WindowSource(str(bad), hop=0.3).iter_batches("train", 0, 0, 1, 0, SOURCES))
