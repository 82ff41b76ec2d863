"""The loss ``L = Σ_m α_m(t) L_m + λ‖θ‖₂`` and how α_m(t) is chosen.

- ``L_m``: class-weighted cross-entropy of modality m's head (the fused head is one more "m"),
  with ``w_c = N_max / (N_c + ε)`` from the server's class counts, so that rare emotions (fear,
  4 % of the data) count as much as neutral.
- ``α_m(t)``: updated once per epoch from the history of the per-modality losses, identically on
  every rank (the history is of losses averaged over all ranks). Two rules:

  * ``dwa`` (the default), Dynamic Weight Average (Liu et al., 2019): a modality whose loss fell
    least in the last epoch gets more weight, ``α_m ∝ exp(r_m / T)`` with ``r_m = L_m(t−1) /
    L_m(t−2)``. It needs no training and is well-behaved from the third epoch on, which is why it is
    the default: a run of a few epochs gives a learned rule nothing to learn from.
  * ``lstm``, the original design: a small LSTM reads the loss history and predicts each
    modality's next loss; it is fitted online, once per epoch, to the history seen so far, and α
    follows the predicted ratio of next to last loss the way DWA follows the observed one.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["class_weights", "modality_losses", "l2_norm", "loss_sum", "DynamicWeightAverage", "LSTMWeighting", "make_weighting"]


def class_weights(counts: Sequence[int], eps: float = 1.0) -> torch.Tensor:
    """``w_c = N_max / (N_c + ε)``."""
    n = torch.tensor([float(c) for c in counts])
    return n.max() / (n + eps)


def loss_sum(terms: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of one or more losses, added in order as ``sum`` adds them (whose result, typed for
    no terms at all, could be the int 0)."""
    it = iter(terms)
    try:
        total = next(it)
    except StopIteration:
        raise ValueError("no loss terms to add up") from None
    for term in it:
        total = total + term
    return total


def modality_losses(logits: Mapping[str, torch.Tensor], labels: torch.Tensor, weights: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return {m: F.cross_entropy(z, labels, weight=weights) for m, z in logits.items()}


def l2_norm(params) -> torch.Tensor:
    return torch.sqrt(sum((p * p).sum() for p in params if p.requires_grad))


class DynamicWeightAverage:
    """α_m(t) = M · softmax_m(r_m(t−1) / T); α = 1 for the first two epochs."""

    def __init__(self, names: Sequence[str], temperature: float = 2.0) -> None:
        self.names = list(names)
        self.temperature = temperature
        self.history: list[list[float]] = []

    def update(self, epoch_losses: Mapping[str, float]) -> None:
        self.history.append([float(epoch_losses[m]) for m in self.names])

    def alphas(self) -> dict[str, float]:
        if len(self.history) < 2:
            return {m: 1.0 for m in self.names}
        last, before = self.history[-1], self.history[-2]
        ratios = [a / max(b, 1e-12) for a, b in zip(last, before)]
        return self._from_ratios(ratios)

    def _from_ratios(self, ratios: Sequence[float]) -> dict[str, float]:
        e = [math.exp(r / self.temperature) for r in ratios]
        return {m: len(self.names) * x / sum(e) for m, x in zip(self.names, e)}

    def state_dict(self) -> dict:
        return {"history": self.history}

    def load_state_dict(self, state: Mapping) -> None:
        self.history = [list(h) for h in state["history"]]


class LSTMWeighting(DynamicWeightAverage):
    """α from an LSTM's prediction of next epoch's losses (see the module docstring)."""

    def __init__(self, names: Sequence[str], temperature: float = 2.0, hidden: int = 16, seed: int = 0) -> None:
        super().__init__(names, temperature)
        gen = torch.Generator().manual_seed(seed)  # the same initial weights on every rank
        self.lstm = nn.LSTM(len(names), hidden, batch_first=True)
        self.out = nn.Linear(hidden, len(names))
        with torch.no_grad():
            for p in [*self.lstm.parameters(), *self.out.parameters()]:
                p.copy_(torch.empty_like(p).uniform_(-0.3, 0.3, generator=gen))
        self.opt = torch.optim.Adam([*self.lstm.parameters(), *self.out.parameters()], lr=1e-2)

    def _predict(self, seq: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(seq)
        return seq[:, -1] * torch.exp(self.out(h[:, -1]))  # predicted next losses, as a ratio of the last

    def update(self, epoch_losses: Mapping[str, float]) -> None:
        super().update(epoch_losses)
        if len(self.history) < 3:
            return
        hist = torch.tensor(self.history, dtype=torch.float32)
        for _ in range(50):  # fit: predict each epoch's losses from the epochs before it
            loss = loss_sum(F.mse_loss(self._predict(hist[None, :t]), hist[None, t]) for t in range(1, len(hist)))
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()

    def alphas(self) -> dict[str, float]:
        if len(self.history) < 3:
            return super().alphas()
        with torch.no_grad():
            hist = torch.tensor(self.history, dtype=torch.float32)[None]
            predicted = self._predict(hist)[0]
        ratios = (predicted / hist[0, -1].clamp_min(1e-12)).tolist()
        return self._from_ratios(ratios)

    def state_dict(self) -> dict:
        return {"history": self.history, "lstm": self.lstm.state_dict(), "out": self.out.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: Mapping) -> None:
        super().load_state_dict(state)
        self.lstm.load_state_dict(state["lstm"])
        self.out.load_state_dict(state["out"])
        self.opt.load_state_dict(state["opt"])


def make_weighting(kind: str, names: Sequence[str]) -> DynamicWeightAverage | None:
    if kind == "dwa":
        return DynamicWeightAverage(names)
    if kind == "lstm":
        return LSTMWeighting(names)
    if kind == "none":
        return None
    raise ValueError(f"--weighting must be dwa, lstm or none, got {kind!r}")
