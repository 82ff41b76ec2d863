"""What the remote-storage tests share: byte-for-byte comparison of batches and a listing of the
copies in a disk cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["SOURCES", "TIMEOUT", "assert_same", "cached_files"]

TIMEOUT = 30.0
SOURCES = ("sample_id", "features", "label", "weight")


def assert_same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, k
            assert x[k].tobytes() == y[k].tobytes(), k


def cached_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.glob("*/data/**/*") if p.is_file())
