"""The code of a stage is part of the sequence fingerprint.

A stage edited under the same ``module:function`` changes what every later batch holds; a server
restarted with it must be refused naming the stage, and two processes running the same code must
agree (``marshal`` bytes and set order differ between processes; the digest must not).
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import FingerprintMismatch
from fuelline.server.multimodal.stages import Normalize, band_power
from fuelline.server.sources.code_digest import callable_digest

TIMEOUT = 20.0
SOURCES = ("sample_id", "eeg")

STAGE = '''
import numpy as np

GAIN = {gain}
SCALED = frozenset({{"eeg", "ecg"}})


def scale(batch):
    """Every scaled modality times GAIN."""
    out = dict(batch)
    for key in batch:
        if key in SCALED and key in {{"eeg", "ecg", "gsr"}}:
            out[key] = np.asarray(batch[key]) * np.float32(GAIN)
    return out
'''


@pytest.fixture
def stage_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``fpstage.py``, importable by the servers the test starts (and by the test)."""
    folder = tmp_path / "stages"
    folder.mkdir()
    path = folder / "fpstage.py"
    path.write_text(STAGE.format(gain=2.0))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p))
    # (a source edited within the second it was compiled, at the same size, would otherwise be run
    # from its stale cached bytecode)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    return path


def test_a_stage_edited_under_the_same_name_is_refused_at_resume_naming_stage_code(
    converted_dataset: Path, stage_module: Path, start_serve
) -> None:
    options = ("--batch-size", "8", "--stage", "fpstage:scale")
    first = start_serve(converted_dataset, *options)
    with ServerDataStream(SOURCES, endpoints=[first.endpoint], timeout=TIMEOUT) as s:
        it = s.get_epoch_iterator()
        next(it)
        state = s.state_dict()
    first.kill()
    stage_module.write_text(STAGE.format(gain=3.0))  # the same size, the same name
    second = start_serve(converted_dataset, *options)
    with ServerDataStream(SOURCES, endpoints=[second.endpoint], timeout=TIMEOUT) as s:
        s.load_state_dict(state)
        with pytest.raises(FingerprintMismatch) as info:
            next(s.get_epoch_iterator())
    assert info.value.differences == ["stage_code"]
    assert "stage_code is 'fpstage:scale #" in str(info.value)


def test_two_server_processes_running_the_same_stage_agree_on_its_code(
    converted_dataset: Path, stage_module: Path, start_serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    servers = []
    for seed in ("1", "2"):  # string hashing, and so set order, differs between them
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        servers.append(start_serve(converted_dataset, "--batch-size", "8", "--stage", "fpstage:scale").endpoint)
    with ServerDataStream(SOURCES, endpoints=servers, timeout=TIMEOUT) as s:
        batches = list(s.get_epoch_iterator())
        fingerprint = s.state_dict()["fingerprint"]
    assert batches
    assert fingerprint["stage_code"].startswith("fpstage:scale #")


# -- the digest itself -------------------------------------------------------------------------


def _load(folder: Path, name: str, source: str):
    (folder / (name.replace(".", "/") + ".py")).write_text(source)
    importlib.invalidate_caches()
    if name in sys.modules:
        return importlib.reload(sys.modules[name])
    return importlib.import_module(name)


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write and (re)import modules of a package ``fpdigest`` of the test's own."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    (tmp_path / "fpdigest").mkdir()
    (tmp_path / "fpdigest" / "__init__.py").write_text("")
    yield lambda name, source: _load(tmp_path, f"fpdigest.{name}", source)
    for name in [n for n in sys.modules if n == "fpdigest" or n.startswith("fpdigest.")]:
        del sys.modules[name]


def test_the_digest_follows_closures_defaults_nested_code_and_helpers_of_the_same_package(modules) -> None:
    modules("helpers", "def gain():\n    return 2.0\n")
    source = '''
from fpdigest.helpers import gain


def make(k):
    def stage(batch, offset={offset}):
        def inner(x):
            return x * {inner}
        return {{key: inner(v) * k * gain() + offset for key, v in batch.items()}}
    return stage


STAGE = make({k})
'''
    first = callable_digest(modules("stages", source.format(offset=0, inner=1, k=2)).STAGE)
    assert callable_digest(modules("stages", source.format(offset=0, inner=1, k=2)).STAGE) == first
    for changed in ({"offset": 1, "inner": 1, "k": 2}, {"offset": 0, "inner": 3, "k": 2},
                    {"offset": 0, "inner": 1, "k": 5}):
        assert callable_digest(modules("stages", source.format(**changed)).STAGE) != first, changed
    modules("helpers", "def gain():\n    return 4.0\n")  # a helper of the same package, edited
    assert callable_digest(modules("stages", source.format(offset=0, inner=1, k=2)).STAGE) != first


def test_the_digest_of_an_instance_holds_its_class_methods_and_attributes(modules) -> None:
    source = '''
def shift(batch, by):
    return {{k: v + by for k, v in batch.items()}}


class Scale:
    def __init__(self, factor):
        self.factor = factor

    def __call__(self, batch):
        return {{k: v * self.factor{extra} for k, v in batch.items()}}
'''
    objects = modules("objects", source.format(extra=""))
    scale, shift = objects.Scale, objects.shift
    two = callable_digest(scale(2.0))
    assert two == callable_digest(scale(2.0))
    assert two != callable_digest(scale(3.0))
    by_one = callable_digest(functools.partial(shift, by=1))
    assert by_one == callable_digest(functools.partial(shift, by=1))
    assert by_one != callable_digest(functools.partial(shift, by=2))
    edited = modules("objects", source.format(extra=" + 1"))
    assert callable_digest(edited.Scale(2.0)) != two
    assert callable_digest(functools.partial(edited.shift, by=1)) != by_one  # (its module's file was edited)
    assert callable_digest(band_power) == callable_digest(band_power)
    stats = {"eeg": {"mean": [0.0] * 14, "std": [1.0] * 14}}
    other = {"eeg": {"mean": [0.0] * 14, "std": [2.0] * 14}}
    assert callable_digest(Normalize(stats)) != callable_digest(Normalize(other))  # the project's: by state


def test_the_digest_is_the_same_in_every_process(modules, tmp_path: Path) -> None:
    source = '''
import numpy as np

NAMES = {"eeg", "ecg", "gsr"}
TABLE = {"a": (1, 2.5), "b": frozenset({"x", "y"}), "c": np.arange(4)}


def stage(batch):
    return {k: v for k, v in batch.items() if k in {"eeg", "video"} or k in NAMES or TABLE}
'''
    modules("same", source)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import fpdigest.same as m; "
            "from fuelline.server.sources.code_digest import callable_digest; print(callable_digest(m.stage))")
    digests = set()
    for seed in ("0", "1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONDONTWRITEBYTECODE": "1"}
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        digests.add(done.stdout.strip())
    assert len(digests) == 1
