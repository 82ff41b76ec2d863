"""1-bit momentum SGD: each rank's own momentum crosses the ranks in 1-bit form.

Design note "per-rank momentum". Heavy-ball SGD fed with error-feedback-compressed gradients
re-applies every late part of a gradient for ``1 / (1 - momentum)`` steps, and the errors it
owes grow with it (see :mod:`fuelline.trainer.onebit_momentum`). Here, as in blockwise momentum
SGD with error feedback (Zheng et al., 2019), each rank keeps the momentum of its *local*
gradients, ``m_i = momentum * m_i + g_i``, uncompressed, and what crosses the wire is its
update ``lr * m_i``. The mean of those updates is the mean of the ranks' momenta, which is the
momentum of the averaged gradient: without compression this is exactly momentum SGD on the
averaged gradient. The compression error is an error in the update, delivered once, one step
late, instead of a gradient error that the momentum keeps re-applying. It is the update, not
the momentum, that is compressed, so the error owed stays right when the learning rate changes.

Design note "decaying error feedback". The 1-bit format sends each element's sign and one scale
per block of 1024, the block's mean magnitude. An element larger than its block's mean is
delivered a mean's worth a step and error feedback owes it the rest, so the error owed grows
until the block's mean reaches its largest element: measured, the send error settled at 10 to
30 times the norm of the update it rides on, the decoded update was mostly a dither of that
magnitude, and training fell apart late (on two ranks as on four). The buffers therefore decay
(``error_decay``, 0.5: halved every step), which bounds what is owed at about one step's error.
What fades is the part of an update that the signs keep failing to deliver, a clipping of the
largest elements, not a gradient the momentum would repeat. Dividing each element by its
warm-up gradient scale before compressing (as 1-bit Adam divides by its frozen variance), and
tracking estimates of the momentum instead of feeding back errors (EF21), were measured too and
kept accuracy less reliably.

On four ranks and more this still trains more slowly than uncompressed momentum SGD (about 5
points of val accuracy behind after 15 epochs on the synth data, see ``benchmarks/convergence.py``)
and the trainer refuses that combination; 1-bit Adam keeps accuracy there.

Usage::

    state = register_momentum_hook(ddp_model)
    optimizer = OneBitSGD(ddp_model.parameters(), lr=0.02, momentum=0.9, warmup_steps=10, state=state)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fuelline.trainer.onebit import OneBitState
from fuelline.trainer.onebit_momentum import CompressedMomentum

__all__ = ["OneBitSGD"]


class OneBitSGD(CompressedMomentum):
    """Momentum SGD for ``warmup_steps`` steps, then per-rank momentum and 1-bit update exchange.

    Before the warm-up ends it is ``torch.optim.SGD`` (dampening 0, no Nesterov) on averaged
    gradients. Weight decay is added to the gradient, as ``torch.optim.SGD`` does.

    From ``warmup_steps`` on, ``p.grad`` holds this rank's local gradient when :meth:`step` runs
    and each rank's ``momentum_buffer`` is its own; the parameters stay identical on all ranks.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        momentum: heavy-ball coefficient (0: plain SGD, compressed the same way).
        weight_decay: L2 penalty added to the gradient.
        warmup_steps: steps of uncompressed SGD on fp32-averaged gradients.
        error_decay: factor applied to the error-feedback buffers every step (see the module's
            design note); 1.0 keeps every bit owed.
        state: the state shared with :func:`~fuelline.trainer.onebit_momentum.momentum_hook`.

    Raises:
        ValueError: a hyperparameter is out of range.
    """

    exchange_key = "onebit_sgd.update"

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        warmup_steps: int = 10,
        error_decay: float = 0.5,
        state: OneBitState | None = None,
    ) -> None:
        if lr < 0.0 or weight_decay < 0.0:
            raise ValueError(f"lr and weight_decay must be >= 0, got {lr}, {weight_decay}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay},
                         warmup_steps=warmup_steps, state=state, error_decay=error_decay)

    def _momentum(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """``p``'s momentum after this step's gradient (a rank's own once compressing)."""
        state = self.state[p]
        buffer = state.get("momentum_buffer")
        if p.grad is None:
            if buffer is None:
                buffer = state["momentum_buffer"] = torch.zeros_like(p)
            return buffer.mul_(group["momentum"])
        grad = p.grad if not group["weight_decay"] else p.grad.add(p, alpha=group["weight_decay"])
        if buffer is None:
            # As torch.optim.SGD: the first step's momentum is the gradient itself.
            buffer = state["momentum_buffer"] = torch.clone(grad).detach()
            return buffer
        return buffer.mul_(group["momentum"]).add_(grad)

    def _warmup_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(self._momentum(group, p), alpha=-group["lr"])

    def _compressed_step(self) -> None:
        # Every parameter takes part, with or without a gradient this step, so all ranks send
        # vectors of the same size in the same order.
        tracked = [(g, p) for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not tracked:
            return
        flat = self._exchange_buffer(sum(p.numel() for _, p in tracked), tracked[0][1].device)
        views, offset = [], 0
        for g, p in tracked:
            view = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            torch.mul(self._momentum(g, p), g["lr"], out=view)
            views.append(view)
        self._exchange(flat)
        for (_, p), view in zip(tracked, views):
            p.sub_(view)
