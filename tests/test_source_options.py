"""One checked options value for every unit source: a Python caller's error names the argument,
the command line's names the flag, and an option that is not one is refused by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fuelline.protocol import OptionError
from fuelline.server import ParquetSource
from fuelline.server.multimodal.source import WindowSource
from fuelline.server.sources.options import SourceOptions


@pytest.mark.parametrize("option, value", [
    ("batch_size", 0), ("shuffle_block", 0), ("workers", -1), ("prefetch", -2), ("decoded_cache_mb", -1),
    ("worker_timeout", -1.0), ("worker_timeout", float("nan")), ("on_bad_shard", "ignore"), ("cache_mb", 0),
    ("batch_size", 2.5), ("seed", "7"),
])
def test_a_library_error_names_the_argument_not_a_flag(sample_dataset: Path, option: str, value: object) -> None:
    with pytest.raises(OptionError) as caught:
        ParquetSource(str(sample_dataset), **{option: value})
    assert caught.value.option == option
    assert str(caught.value).startswith(f"{option} must be ")
    assert "--" not in str(caught.value)


@pytest.mark.parametrize("option, value", [("window", 0.0), ("hop", -1.0), ("max_gap", -1), ("normalize", "minmax")])
def test_window_options_name_the_argument(converted_dataset: Path, option: str, value: object) -> None:
    with pytest.raises(OptionError) as caught:
        WindowSource(str(converted_dataset), **{option: value})
    assert caught.value.option == option and "--" not in str(caught.value)


def test_an_unknown_option_is_refused_with_the_list(sample_dataset: Path) -> None:
    with pytest.raises(TypeError, match=r"unknown source option\(s\) \['batch'\].*'batch_size'"):
        ParquetSource(str(sample_dataset), batch=32)


def test_options_as_one_value_or_by_name_are_the_same(sample_dataset: Path) -> None:
    options = SourceOptions(batch_size=100, seed=3, shuffle_block=2)
    a = ParquetSource(str(sample_dataset), options)
    b = ParquetSource(str(sample_dataset), batch_size=100, seed=3, shuffle_block=2)
    assert a.options == b.options == options
    assert a.fingerprint("train") == b.fingerprint("train")
    # Overrides apply on top of a given value, which stays as it was (frozen).
    c = ParquetSource(str(sample_dataset), options, batch_size=50)
    assert c.batch_size == 50 and options.batch_size == 100


def test_the_old_name_of_shuffle_block_still_works_and_warns(sample_dataset: Path) -> None:
    with pytest.warns(DeprecationWarning, match="shuffle_block"):
        source = ParquetSource(str(sample_dataset), block_units=3)
    assert source.shuffle_block == 3


def test_numpy_integers_are_whole_numbers(sample_dataset: Path) -> None:
    np = pytest.importorskip("numpy")
    assert SourceOptions(batch_size=np.int64(32)).batch_size == 32


@pytest.mark.parametrize("flag, value", [("--window", "0"), ("--max-gap", "-1"), ("--hop", "-0.5")])
def test_the_command_line_names_the_flag(converted_dataset: Path, flag: str, value: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fuelline.server.cli", "serve", str(converted_dataset), "--port", "0", flag, value],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert f"fuelline serve: error: {flag} must be" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_convert_names_the_argument_and_its_command_line_the_flag(tmp_path: Path) -> None:
    from fuelline.server.ingest.convert import convert
    from fuelline.server.ingest.synth import synthesize

    synthesize(str(tmp_path / "raw"), 2, 4.0, 3, video_dim=4)
    with pytest.raises(OptionError, match=r"^val_fraction 0\.9 leaves no recording in the train split"):
        convert(str(tmp_path / "raw"), str(tmp_path / "a"), val_fraction=0.9, progress=False)
    with pytest.raises(OptionError, match=r"^recordings_per_shard must be >= 1"):
        convert(str(tmp_path / "raw"), str(tmp_path / "b"), recordings_per_shard=0, progress=False)
    result = subprocess.run(
        [sys.executable, "-m", "fuelline.server.cli", "convert", str(tmp_path / "raw"), str(tmp_path / "c"),
         "--val-fraction", "0.9"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "fuelline convert: error: --val-fraction 0.9 leaves no recording in the train split" in result.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
