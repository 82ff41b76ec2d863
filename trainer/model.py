"""The multimodal emotion classifier: an encoder per modality, a fusion layer, and a head per
modality plus the fused head, so that every modality has a loss of its own.

Shapes come from the data server's schema, so any window length works: ``eeg`` / ``ecg`` /
``gsr`` are (B, channels, samples), ``video`` is (B, frames, features).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

__all__ = ["MODALITIES", "SignalEncoder", "VideoEncoder", "EmotionNet"]

MODALITIES = ("eeg", "ecg", "gsr", "video")


class SignalEncoder(nn.Module):
    """Strided 1-d convolutions over time, then the mean over what is left of it."""

    def __init__(self, channels: int, samples: int, width: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c, t = channels, samples
        for _ in range(3):
            stride = 4 if t >= 16 else 1  # a 4 Hz GSR window has only 8 samples
            layers += [nn.Conv1d(c, width, kernel_size=5, stride=stride, padding=2), nn.BatchNorm1d(width), nn.GELU()]
            c, t = width, -(-t // stride)
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).mean(dim=-1)


class VideoEncoder(nn.Module):
    """Per-frame projection of the face features, a temporal convolution, then the mean."""

    def __init__(self, features: int, width: int) -> None:
        super().__init__()
        self.frame = nn.Sequential(nn.Linear(features, width), nn.GELU())
        self.time = nn.Sequential(nn.Conv1d(width, width, kernel_size=5, padding=2), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.time(self.frame(x).transpose(1, 2)).mean(dim=-1)


class EmotionNet(nn.Module):
    """Logits per modality and fused: ``forward(batch) -> {"eeg": …, …, "fused": …}``.

    Args:
        schema: per source ``{"dtype", "shape"}`` as the server's welcome gives it.
        classes: number of emotions.
        width: feature width of every encoder.
        modalities: which modalities to use (all four by default).
    """

    def __init__(self, schema: Mapping[str, Mapping], classes: int, width: int = 32,
                 modalities: Sequence[str] = MODALITIES) -> None:
        super().__init__()
        self.modalities = tuple(modalities)
        encoders = {}
        for m in self.modalities:
            shape = schema[m]["shape"]
            encoders[m] = VideoEncoder(shape[1], width) if m == "video" else SignalEncoder(shape[0], shape[1], width)
        self.encoders = nn.ModuleDict(encoders)
        self.heads = nn.ModuleDict({m: nn.Linear(width, classes) for m in self.modalities})
        self.fusion = nn.Sequential(nn.Linear(width * len(self.modalities), width), nn.GELU(), nn.Dropout(0.1))
        self.fused_head = nn.Linear(width, classes)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        features = {m: self.encoders[m](batch[m]) for m in self.modalities}
        logits = {m: self.heads[m](f) for m, f in features.items()}
        logits["fused"] = self.fused_head(self.fusion(torch.cat([features[m] for m in self.modalities], dim=1)))
        return logits
