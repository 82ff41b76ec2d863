"""A user's data set and models for the convergence benchmark: scikit-learn's digits, unnormalised.

The data set is ``sklearn.datasets.load_digits`` as shipped (1,797 images of 8 x 8 pixels, each an
integer 0..16), split with ``train_test_split(test_size=0.2, random_state=0)``: 1,437 train and 360
val images. It is written the way a user would write it with pyarrow, one Parquet file per split
folder (``train/``, ``val/``), columns ``sample_id`` int64 (the image's index in ``load_digits``),
``image`` float32 [8, 8] (the pixels divided by ``scale``, 1 by default: 0..16, not z-scored) and
``label`` int64 (the digit). ``fuelline serve`` serves it as it is: its ``--normalize`` applies to
converted multimodal datasets only.

The models are what a user would bring with ``--model``, without a normalisation layer of their
own: ``--model benchmarks.digits:mlp`` (64 -> 128 -> 10) and ``--model benchmarks.digits:cnn``
(two 3 x 3 convolutions over the 1 x 8 x 8 image, then 64 -> 10). The trainer's ranks import this
module, so it imports neither pyarrow nor scikit-learn until a data set is written.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from fuelline.protocol import DataError
from fuelline.trainer.model_spec import ModelSpec

__all__ = ["SOURCE", "TRAIN_ROWS", "VAL_ROWS", "ensure_dataset", "write_dataset", "mlp", "cnn"]

SOURCE = "image"
SPLIT_SEED, VAL_SIZE = 0, 0.2  # train_test_split's random_state and test_size
TRAIN_ROWS, VAL_ROWS = 1437, 360
ROW_GROUP_ROWS = 256  # a few row groups per split, so that the server's shuffle has units to permute


def write_dataset(out: Path, scale: float = 1.0) -> dict[str, int]:
    """Write the digits data set to ``out`` (atomically) and return rows per split.

    Raises:
        ImportError: scikit-learn is not installed.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from fuelline.protocol.common.atomic import atomic_directory

    pixels, labels = load_digits(return_X_y=True)
    ids = np.arange(len(labels), dtype=np.int64)
    train, val = train_test_split(ids, test_size=VAL_SIZE, random_state=SPLIT_SEED)
    counts = {}
    with atomic_directory(str(out), "dataset") as tmp:
        for split, rows in (("train", train), ("val", val)):
            os.makedirs(os.path.join(tmp, split))
            image = (pixels[rows] / scale).astype(np.float32).reshape(-1)
            table = pa.table({
                "sample_id": pa.array(ids[rows]),
                SOURCE: pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(pa.array(image), 8), 8),
                "label": pa.array(labels[rows].astype(np.int64)),
            })
            pq.write_table(table, os.path.join(tmp, split, "digits.parquet"), row_group_size=ROW_GROUP_ROWS)
            counts[split] = len(rows)
    return counts


def ensure_dataset(data_dir: Path, scale: float = 1.0) -> Path:
    """The digits data set with pixels divided by ``scale``, written once in ``data_dir``."""
    data = data_dir / f"digits-v1-split{SPLIT_SEED}-scale{scale:g}"
    if not data.is_dir():
        write_dataset(data, scale)
    return data


def _check_image(spec: ModelSpec, name: str) -> None:
    shape = list(spec.schema.get(SOURCE, {}).get("shape") or [])
    if shape != [8, 8]:
        raise DataError(f"benchmarks.digits:{name} needs a source {SOURCE!r} of shape [8, 8]; the server serves "
                        f"{ {k: list(v.get('shape', [])) for k, v in spec.schema.items()} }")


class MLP(nn.Module):
    """Logits ``[B, classes]`` from the flattened 8 x 8 image."""

    def __init__(self, classes: int, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(batch[SOURCE])


class CNN(nn.Module):
    """Logits ``[B, classes]`` from the image as one channel of 8 x 8."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),  # 32 x 4 x 4
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.features(batch[SOURCE].unsqueeze(1)))


def mlp(spec: ModelSpec) -> nn.Module:
    """``--model benchmarks.digits:mlp``."""
    _check_image(spec, "mlp")
    return MLP(spec.classes)


def cnn(spec: ModelSpec) -> nn.Module:
    """``--model benchmarks.digits:cnn``."""
    _check_image(spec, "cnn")
    return CNN(spec.classes)
