"""Master grids: windows cut from them equal windows resampled one by one; bad grids are named;
``fuelline upgrade`` adds the grids ``fuelline convert`` writes, atomically."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fuelline.protocol import DataError
from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize
from fuelline.server.ingest.upgrade import upgrade
from fuelline.server.multimodal.align import resample
from fuelline.server.multimodal.grid import cut_windows
from fuelline.server.multimodal.manifest import NEAREST, Manifest
from fuelline.server.multimodal.source import WindowSource
from fuelline.server.multimodal.stages import Normalize

from support.formats import strip_grids

MODS = ("eeg", "ecg", "gsr", "video")
SOURCES = (*MODS, "label", "sample_id", "t_start")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight recordings with dropped samples and dropout runs, so that some recordings' valid
    windows come in several runs."""
    root = tmp_path_factory.mktemp("grid")
    synthesize(str(root / "raw"), 8, 20.0, 5, video_dim=4, drop=0.01, jitter_ms=0.3)
    convert(str(root / "raw"), str(root / "data"), val_fraction=0.25, seed=0, recordings_per_shard=3, progress=False)
    return root / "data"


def older(dataset: Path, to: Path, fmt: str = "fuelline-multimodal/2") -> Path:
    """A copy of ``dataset`` as an earlier version wrote it: no grids, an older format."""
    shutil.copytree(dataset, to)
    strip_grids(to, fmt)
    return to


def close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal within float32 rounding (grid times and window times may round differently)."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    scale = float(np.abs(want).max()) if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * scale, err_msg=what)


@pytest.mark.parametrize("window, hop", [(2.0, 1.0), (2.0, 0.5), (1.0, 0.25), (3.0, 3.0), (2.0, 0.3)])
def test_windows_cut_from_grids_equal_windows_resampled_one_by_one(dataset: Path, window: float, hop: float) -> None:
    src = WindowSource(str(dataset), window=window, hop=hop, normalize="none")
    rates = {m: src.manifest.modalities[m].rate for m in MODS}
    # Cut from the grid where the hop is a whole number of periods (0.25 s is 7.5 video frames,
    # 0.3 s no whole number of EEG, ECG or GSR periods), resampled one by one elsewhere.
    assert {m for m in MODS if src.steps[m] is None} == {m for m in MODS if abs(hop * rates[m] - round(hop * rates[m])) > 1e-9}
    assert {m for m in MODS if src.steps[m] is None} == {(1.0, 0.25): {"video"}, (2.0, 0.3): {"eeg", "ecg", "gsr"}}.get((window, hop), set())
    several_runs = 0
    for split in src.splits:
        for u in range(len(src.unit_rows(split))):
            signals, starts = src.recording(split, u)
            got = src.windows(split, u)
            assert len(got["t_start"]) == len(starts) == src.unit_rows(split)[u]
            np.testing.assert_array_equal(got["t_start"], starts)
            for m in MODS:
                close(got[m], resample(signals[m], starts, src.spec, channels_first=m not in NEAREST), f"{split} {u} {m}")
            shared = src.decode_unit(split, u, src.column_specs(SOURCES))
            assert not any(a.flags.writeable for a in shared.values())  # shared by batches and clients
            k = np.rint((starts - starts[0]) / hop).astype(int) if len(starts) else starts
            several_runs += bool(len(k)) and bool((np.diff(k) != 1).any())
    assert several_runs, "the data set should have recordings whose valid windows come in several runs"
    src.close()


def test_zscore_batches_are_the_raw_batches_normalised_and_decoded_units_stay_raw(dataset: Path) -> None:
    """z-scored batches are the raw ones normalised, in storage order and shuffled, and again in
    an epoch served from the decoded units the first one kept: nothing shared is written twice."""
    for shuffle in (True, False):
        raw = WindowSource(str(dataset), normalize="none", batch_size=8, shuffle=shuffle)
        z = WindowSource(str(dataset), normalize="zscore", batch_size=8, shuffle=shuffle, decoded_cache_mb=64)
        norm = Normalize(Manifest.load(str(dataset)).stats)
        want = [norm(b) for b in raw.iter_batches("train", 0, 0, 1, 0, SOURCES)]
        for epoch in range(2):  # the second from the decoded units the first kept
            got = list(z.iter_batches("train", 0, 0, 1, 0, SOURCES))
            assert len(got) == len(want) > 2
            for g, w in zip(got, want):
                for key in SOURCES:
                    np.testing.assert_array_equal(g[key], w[key], err_msg=f"shuffle {shuffle} epoch {epoch} {key}")
        raw.close()
        z.close()


def test_cut_windows_selects_any_windows_of_a_grid() -> None:
    rng = np.random.default_rng(0)
    grid = rng.standard_normal((3, 100)).astype(np.float32)
    frames = rng.standard_normal((100, 5)).astype(np.float32)
    for first in ([0, 1, 2, 3], [1, 2, 5, 6, 7, 11], [4], []):
        k = np.array(first, dtype=np.int64)
        got = cut_windows(grid, k, 7, 10, nearest=False)
        np.testing.assert_array_equal(got, np.array([grid[:, i * 7 : i * 7 + 10] for i in k]).reshape(len(k), 3, 10))
        got = cut_windows(frames, k, 7, 10, nearest=True)
        np.testing.assert_array_equal(got, np.array([frames[i * 7 : i * 7 + 10] for i in k]).reshape(len(k), 10, 5))
    with pytest.raises(DataError, match="window 13 needs 101 grid points, the grid has 100"):
        cut_windows(grid, np.array([13]), 7, 10, nearest=False)


def test_a_grid_that_disagrees_with_its_manifest_is_named(dataset: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    rec = manifest["recordings"][0]
    rec["modalities"]["eeg"]["grid_points"] += 1
    (bad / "manifest.json").write_text(json.dumps(manifest))
    # (the first recording's windows are cut when the source starts, to see what it serves)
    with pytest.raises(DataError, match=rf"grid .*eeg/grid-00000\.arrow \(recording {rec['id']}, eeg\): grid 0 holds \d+ values, the manifest says 14 × \d+"):
        WindowSource(str(bad), normalize="none")
    rec["modalities"]["eeg"]["grid_points"] -= 1
    (bad / "manifest.json").write_text(json.dumps(manifest))
    (bad / "ecg" / "grid-00001.arrow").write_bytes(b"ARROW1 not really")
    src = WindowSource(str(bad), normalize="none")
    unit = next(u for u, (_, r) in enumerate(src._splits["train"].recordings) if r.modalities["ecg"].grid_file.endswith("00001.arrow"))
    with pytest.raises(DataError, match=r"grid .*ecg/grid-00001\.arrow: "):
        src.decode_unit("train", unit, src.column_specs(SOURCES))


def test_an_older_dataset_is_refused_with_the_command_that_upgrades_it(dataset: Path, tmp_path: Path, start_serve) -> None:
    old = older(dataset, tmp_path / "old")
    done = subprocess.run([sys.executable, "-m", "fuelline.server.cli", "serve", str(old), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"format 'fuelline-multimodal/2' predates 'fuelline-multimodal/3', which this version serves; `fuelline upgrade {old}`" in done.stderr
    assert "Traceback" not in done.stderr


def test_upgrade_writes_the_grids_convert_writes_and_fails_without_changing_the_dataset(dataset: Path, tmp_path: Path) -> None:
    old = older(dataset, tmp_path / "old")
    shard = old / "video" / "part-00002.parquet"
    intact = shard.read_bytes()
    shard.write_bytes(intact[: len(intact) // 2])  # the last shard of the last modality: most work done first
    before = (old / "manifest.json").read_bytes()
    with pytest.raises(DataError, match=r"video/part-00002\.parquet"):
        upgrade(str(old), progress=False)
    assert (old / "manifest.json").read_bytes() == before
    assert not [p for p in old.rglob("*") if ".tmp-" in p.name]
    with pytest.raises(DataError, match="predates"):
        WindowSource(str(old))

    shard.write_bytes(intact)
    done = subprocess.run([sys.executable, "-m", "fuelline.server.cli", "upgrade", str(old)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"upgraded {old} from fuelline-multimodal/2 to fuelline-multimodal/3")
    for grid in sorted(dataset.glob("*/*grid-*.arrow")):
        assert (old / grid.relative_to(dataset)).read_bytes() == grid.read_bytes(), grid
    upgraded, fresh = Manifest.load(str(old)), Manifest.load(str(dataset))
    assert upgraded.recordings == fresh.recordings
    assert upgraded.extra["upgraded_from"] == "fuelline-multimodal/2"
    assert upgraded.dataset_bytes == sum(p.stat().st_size for p in old.rglob("*") if p.is_file())
    again = subprocess.run([sys.executable, "-m", "fuelline.server.cli", "upgrade", str(old)],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "already fuelline-multimodal/3; nothing to do" in again.stdout


def test_upgrade_refuses_a_remote_dataset() -> None:
    with pytest.raises(DataError, match=r"s3://bucket/data: upgrade works on a local copy"):
        upgrade("s3://bucket/data")


def test_a_server_maps_grids_and_leaves_no_file_open_per_window(dataset: Path) -> None:
    """Each grid file is mapped once per source, however many windows are cut from it."""
    src = WindowSource(str(dataset), normalize="none")
    for _ in range(2):
        list(src.iter_batches("train", 0, 0, 1, 0, SOURCES))
    files = {p.grid_file for _, r in src._splits["train"].recordings for p in r.modalities.values()}
    assert set(src._grid_files) == files
    fds = len(os.listdir("/proc/self/fd"))
    list(src.iter_batches("train", 1, 0, 1, 0, SOURCES))
    assert len(os.listdir("/proc/self/fd")) <= fds
    src.close()


@pytest.mark.parametrize("shuffle", [False, True])
def test_served_rows_are_each_recordings_valid_windows_once(dataset: Path, shuffle: bool) -> None:
    """Recordings whose valid windows come in several runs decode to views of their grids with
    the rows they serve beside them (``ROWS``); every batch row is the right window, once."""
    from fuelline.server.sources.block_reader import ROWS

    src = WindowSource(str(dataset), batch_size=7, shuffle=shuffle, seed=4)
    want: dict[int, dict[str, np.ndarray]] = {}
    several = 0
    for u in range(len(src.unit_rows("train"))):
        shared = src.decode_unit("train", u, src.column_specs(SOURCES))
        if ROWS in shared:
            several += 1
            assert len(shared["eeg"]) > len(shared[ROWS]) and shared["eeg"].base is not None  # a view, not a copy
        w = src.windows("train", u)
        for i, sid in enumerate(w["sample_id"].tolist()):
            want[sid] = {k: w[k][i] for k in SOURCES}
    assert several
    served = [b for b in src.iter_batches("train", 0, 0, 1, 0, SOURCES)]
    ids = np.concatenate([b["sample_id"] for b in served]).tolist()
    assert sorted(ids) == sorted(want) and len(ids) == len(set(ids))
    if not shuffle:
        assert ids == list(want)  # storage order
    for b in served:
        for i, sid in enumerate(b["sample_id"].tolist()):
            for k in SOURCES:
                np.testing.assert_array_equal(b[k][i], want[sid][k], err_msg=f"{sid} {k}")
    src.close()


def test_decoded_units_are_budgeted_at_their_grids_bytes_not_their_windows(dataset: Path) -> None:
    """Windows at a 1 s hop of 2 s overlap twice over: the decoded cache counts the grid they are
    views of once, so a budget holds twice the windows it would if each view counted in full."""
    from fuelline.server.cache.decoded import held_bytes

    g = np.zeros((14, 1000), dtype=np.float32)
    views = np.lib.stride_tricks.sliding_window_view(g, 256, axis=1)[:, ::128].transpose(1, 0, 2)
    assert held_bytes({"eeg": views, "some": views[2:5], "label": np.arange(7)}) == g.nbytes + 7 * 8
    src = WindowSource(str(dataset), decoded_cache_mb=64)
    for _ in src.iter_batches("train", 0, 0, 1, 0, SOURCES):
        pass
    kept = src._decoded
    assert kept is not None and len(kept) == len(src.unit_rows("train"))
    want = views_total = 0
    for u, (_, rec) in enumerate(src._splits["train"].recordings):
        unit = src.decode_unit("train", u, src.column_specs(SOURCES))
        small = sum(a.nbytes for k, a in unit.items() if k not in MODS)
        want += small + sum(int(np.prod(src._grid(rec, m).shape)) * 4 for m in MODS)
        views_total += small + sum(unit[m].nbytes for m in MODS)
    assert kept.held_bytes == want < views_total
    src.close()


def test_an_upgrade_that_cannot_write_names_the_file_and_leaves_the_dataset(dataset: Path, tmp_path: Path) -> None:
    """A full disk, a permission, a path in the way: one line naming the file, exit 2, and the
    dataset still the one older servers read."""
    old = older(dataset, tmp_path / "old")
    (old / "gsr" / "grid-00001.arrow").mkdir()  # in the way of the file upgrade renames into place
    before = (old / "manifest.json").read_bytes()
    done = subprocess.run([sys.executable, "-m", "fuelline.server.cli", "upgrade", str(old)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "gsr/grid-00001.arrow" in lines[0] and "left as it was" in lines[0], done.stderr
    assert (old / "manifest.json").read_bytes() == before
    assert not [p for p in old.rglob("*") if ".tmp-" in p.name]
