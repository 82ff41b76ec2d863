"""Train a model of your own with fuelline's trainer: a small MLP over a ``features`` vector.

The trainer imports ``build`` and calls it with a :class:`fuelline.trainer.model_spec.ModelSpec`
(the sources, their shapes and dtypes, the number of classes, the trainer's ``--width``...)::

    fuelline sample data                                  # features [16] float32, label int64
    fuelline serve data --batch-size 64 &
    PYTHONPATH=. torchrun --nproc_per_node 2 -m fuelline.trainer --servers 127.0.0.1:5557 \\
        --model examples.own_model:build --epochs 2

Everything else stays the trainer's: DDP, gradient compression, checkpoints, metrics. Run this
file on its own to see the model and its output for a batch shaped like the sample dataset's.
"""

from __future__ import annotations

import torch
from torch import nn

from fuelline.protocol import DataError
from fuelline.trainer.model_spec import ModelSpec

SOURCE = "features"


class MLP(nn.Module):
    """Logits ``[B, classes]`` from ``batch["features"]`` ``[B, dim]``."""

    def __init__(self, dim: int, width: int, classes: int) -> None:
        super().__init__()
        # BatchNorm first: the features' scale is whatever the dataset's is.
        self.net = nn.Sequential(nn.BatchNorm1d(dim), nn.Linear(dim, width), nn.GELU(), nn.Linear(width, classes))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(batch[SOURCE])


def build(spec: ModelSpec) -> nn.Module:
    """The model for ``--model examples.own_model:build``."""
    shape = spec.schema.get(SOURCE, {}).get("shape")
    if shape is None or len(shape) != 1:
        raise DataError(f"examples.own_model needs a source {SOURCE!r} of shape [dim]; "
                        f"the server serves {list(spec.schema)}")
    return MLP(shape[0], spec.width, spec.classes)


if __name__ == "__main__":
    spec = ModelSpec(sources=("sample_id", "features", "label"),
                     schema={"sample_id": {"dtype": "int64", "shape": []},
                             "features": {"dtype": "float32", "shape": [16]},
                             "label": {"dtype": "int64", "shape": []}},
                     classes=6, class_names=None, label_source="label", width=32, seed=0, info={})
    model = build(spec)
    print(model)
    print("logits", tuple(model({"features": torch.randn(4, 16)}).shape))
