"""1-bit Adam: Adam whose momentum, not gradient, crosses the ranks in 1-bit form.

Design note "why the momentum". Adam divides by the square root of its variance, an estimate
made from the gradients themselves. Fed with sign-compressed gradients, that estimate is wrong in
a way error feedback cannot undo (the compression error enters non-linearly), and training does
not converge. Once training has settled, though, the variance changes slowly (Tang et al., 2021,
"1-bit Adam"): it can be frozen, and with a frozen variance Adam's update is linear in the
momentum, which compresses with error feedback as well as a gradient does under SGD.

The arrangement keeps each piece where DDP and ``torch.optim`` expect it:

* ``onebit_adam_hook`` is the DDP hook. During the warm-up it averages gradients with a plain
  fp32 all-reduce and :class:`OneBitAdam` is Adam. From step ``freeze_step`` on it communicates
  nothing and hands DDP the local gradients.
* From then on :meth:`OneBitAdam.step` updates each rank's momentum with its local gradient,
  averages the momentum with :func:`fuelline.trainer.onebit.onebit_allreduce` (two-phase 1-bit
  exchange, send and reduce error feedback under one fixed key, so DDP's bucket rebuilds do not
  matter) and applies Adam's update with the frozen variance.

The warm-up, the phase switch and the exchange are those of every compressed-momentum optimizer
(:class:`~fuelline.trainer.onebit_momentum.CompressedMomentum`). The trainer runs this algorithm
for ``--compression onebit --optimizer adam`` (and ``--optimizer onebit-adam``, its old name).

Design note "quiet parameters". A parameter that got (almost) no gradient during the warm-up (a
hidden unit that was dead, a weight of an input that was zero) freezes a variance near zero, so
Adam's frozen denominator is about ``eps``. When it wakes up after the freeze, its momentum
divided by that denominator is enormous: the update blows up, the block's 1-bit scale spreads the
blow-up over its neighbours, and the run goes to NaN within a few steps (unnormalised inputs make
this common). Two bounds keep the compressed phase within what Adam itself would do:

* at the freeze, each parameter's variance is floored at ``VARIANCE_FLOOR`` of its tensor's
  median variance (the same on every rank: it is computed from averaged gradients), so a quiet
  element divides by a denominator of its tensor's scale, not by ``eps``;
* the normalised momentum (momentum over the frozen denominator, what is exchanged) is clamped to
  ``± max(1, (1 - beta1) / sqrt(1 - beta2))``, the largest step per unit learning rate that Adam
  with a live variance can take (Kingma & Ba, 2015, section 2.1), before it is compressed.

Both share one :class:`~fuelline.trainer.onebit.OneBitState`: the optimizer sets its
``local_gradients`` flag when the variance freezes, and its byte counters add the warm-up
all-reduce and the compressed momentum alike. The averaged momentum is decoded from the same
bytes on every rank and the variance was frozen from identically averaged gradients, so the
parameters stay bit-identical across ranks.

Usage::

    state = register_onebit_adam(ddp_model)
    optimizer = OneBitAdam(ddp_model.parameters(), lr=1e-3, freeze_step=100, state=state)
"""

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch

from fuelline.trainer.onebit import OneBitState
from fuelline.trainer.onebit_momentum import (
    CompressedMomentum,
    momentum_hook,
    register_momentum_hook,
)

logger = logging.getLogger(__name__)

__all__ = ["OneBitAdam", "onebit_adam_hook", "register_onebit_adam"]

# At the freeze, no element's variance stays below this share of its tensor's median variance.
VARIANCE_FLOOR = 1e-2

# The hook and its registration are those of every compressed-momentum optimizer.
onebit_adam_hook = momentum_hook
register_onebit_adam = register_momentum_hook


class OneBitAdam(CompressedMomentum):
    """Adam for ``freeze_step`` steps, then Adam with frozen variance and 1-bit momentum exchange.

    Weight decay is decoupled (as AdamW, and as DeepSpeed's 1-bit Adam): it is applied to the
    parameters, which are identical on all ranks, so it never goes through compression.

    From ``freeze_step`` on, ``p.grad`` holds this rank's local gradient when :meth:`step` runs
    (the hook no longer averages it): gradient clipping or gradient-norm logging between
    ``backward()`` and ``step()`` sees local values.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: coefficients of the momentum and variance running averages.
        eps: added to the denominator.
        weight_decay: decoupled weight decay.
        freeze_step: steps of uncompressed Adam before the variance freezes. Make it long enough
            for the variance to settle (the paper uses about 15-25 % of training).
        state: the state shared with :func:`onebit_adam_hook` on the DDP model.

    Raises:
        ValueError: a hyperparameter is out of range.
        RuntimeError: (from :meth:`step`) a parameter got its first gradient after the variance
            froze; it has no variance to divide by.
    """

    # The key checkpoints have always saved 1-bit Adam's error buffers under.
    exchange_key = "onebit_adam.momentum"

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100,
        state: OneBitState | None = None,
    ) -> None:
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(
                f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}"
            )
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if freeze_step < 1:
            raise ValueError(
                f"freeze_step must be >= 1 (the variance needs a gradient), got {freeze_step}"
            )
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay},
                         warmup_steps=freeze_step, state=state)
        # Per parameter, its frozen denominator (see _frozen_denom).
        self._denoms: dict[torch.Tensor, torch.Tensor] = {}

    @property
    def freeze_step(self) -> int:
        """Steps of plain Adam before the variance freezes (the warm-up)."""
        return self.warmup_steps

    def _warmup_step(self) -> None:
        # Plain Adam on the gradients the hook has already averaged.
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                # Updates of the variance, frozen with it: its bias correction stops there too.
                state["variance_steps"] = state["step"]
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                self._update(group, p)

    def _compressed_step(self) -> None:
        # Every parameter that has a variance takes part, with or without a gradient this step,
        # so all ranks send momentum vectors of the same size.
        tracked = [(g, p) for g in self.param_groups for p in g["params"] if p in self.state]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p not in self.state:
                    raise RuntimeError(
                        "a parameter received its first gradient after freeze_step; "
                        "1-bit Adam has no variance for it"
                    )
        if not tracked:
            return
        if self.steps == self.warmup_steps:
            self._floor_variances(tracked)
        # What travels is the momentum divided by the frozen denominator (the same on every rank,
        # so averaging it is averaging the momentum). A block's one scale then fits all of its
        # elements: raw momenta of a parameter with a tiny variance sit in blocks scaled by
        # larger neighbours, and dividing their sign·scale by that tiny variance blew them up.
        # It is written straight into the exchange's buffer, and averaged there.
        flat = self._exchange_buffer(sum(p.numel() for _, p in tracked), tracked[0][1].device)
        views, offset = [], 0
        for group, p in tracked:
            state = self.state[p]
            state["step"] += 1
            exp_avg = state["exp_avg"]
            if p.grad is not None:
                exp_avg.lerp_(p.grad, 1 - group["betas"][0])  # (as torch.optim.Adam)
            else:
                exp_avg.mul_(group["betas"][0])
            view = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            bound = self._bound(group)
            torch.div(exp_avg, self._frozen_denom(group, p), out=view).clamp_(-bound, bound)
            views.append(view)
        self._exchange(flat)
        for (group, p), view in zip(tracked, views):
            state = self.state[p]
            # The averaged momentum is the exchanged vector times the denominator; the update,
            # momentum over denominator, is the exchanged vector itself.
            torch.mul(view, self._frozen_denom(group, p), out=state["exp_avg"])
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            bias_correction1 = 1 - group["betas"][0] ** state["step"]
            p.add_(view, alpha=-group["lr"] / bias_correction1)

    def _frozen_denom(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """``p``'s denominator once the variance is frozen: computed once, then reused (one
        tensor per parameter; not saved, a loaded state computes it again)."""
        denom = self._denoms.get(p)
        if denom is None:
            denom = self._denoms[p] = self._denom(group, p)
        return denom

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._denoms.clear()

    @staticmethod
    def _bound(group: dict[str, Any]) -> float:
        """The largest normalised momentum exchanged: Adam's own bound on a step per unit of lr."""
        beta1, beta2 = group["betas"]
        return max(1.0, (1.0 - beta1) / math.sqrt(1.0 - beta2))

    def _floor_variances(self, tracked: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        """Once, as the variance freezes: no element below ``VARIANCE_FLOOR`` of its tensor's median."""
        self._denoms.clear()
        for _, p in tracked:
            v = self.state[p]["exp_avg_sq"]
            floor = VARIANCE_FLOOR * float(v.median())
            quiet = int((v < floor).sum())
            if quiet:
                v.clamp_(min=floor)
                logger.debug("%d of %d variances of a %s parameter floored at %.3g", quiet, v.numel(),
                             tuple(p.shape), floor)

    def _denom(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        bias_correction2 = 1 - group["betas"][1] ** state["variance_steps"]
        return (state["exp_avg_sq"] / bias_correction2).sqrt_().add_(group["eps"])

    def _update(self, group: dict[str, Any], p: torch.Tensor) -> None:
        state = self.state[p]
        beta1 = group["betas"][0]
        bias_correction1 = 1 - beta1 ** state["step"]
        denom = self._denom(group, p)
        if group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bias_correction1)
