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

Design note "per-tensor scales". A block of 1024 elements shares one scale, and the exchanged
vector runs the tensors end to end, so a block mixes tensors: a layer's bias sits among its
weights. Every element of a block is delivered the block's mean magnitude, so a quiet tensor
beside a loud one takes the loud one's steps, a dither it is not owed, and with the decaying
error feedback an update under about a sixth of its block's mean is not delivered at all (its
signs alternate). On unnormalised inputs a first layer's weight gradients carry the inputs'
scale and its bias's do not: on scikit-learn's digits, the most inflated bias of a small MLP or
CNN took steps (RMS) 2.8 times those uncompressed momentum SGD takes for it with the pixels over
16, 19 times with raw pixels (0 to 16) and 67 times with pixels of 0 to 256; a tensor with no
gradient at all moves. So each tensor is divided by its scale, the mean magnitude of its update
averaged over the ranks, before it is compressed, and multiplied by it again once decoded: every
tensor enters its blocks at a mean magnitude of about one and takes steps of its own size (0.7
to 1.8 times its uncompressed ones, measured the same way). The scales cross the ranks in one
fp32 all-reduce of one float per tensor, the same on every rank, so the replicas stay
bit-identical; a tensor quiet on every rank has scale 0 and does not move, as under
``torch.optim.SGD``. Nothing is frozen from the warm-up: a tensor that wakes late is scaled by
what it carries now (1-bit Adam's frozen variance needed a floor and a bound for that). Within a
tensor nothing changes: an element quiet among loud ones of its own tensor is still delivered its
block's mean. The scales cost one small all-reduce and 4 bytes per tensor a step: nothing beside
the signs of a model of millions of elements, 43 % more on the trainer's synth model (52
tensors, 3,750 elements).

This is not a guard against divergence, which was not found: nothing here divides by a small
quantity, every step is at most its block's mean magnitude, and the decaying error feedback clips
rather than amplifies. On those digits (pixels over 16, raw, and 0 to 256; MLP and CNN; warm-ups
of 10 and 100 steps; seeds 0 to 2) 1-bit SGD trained at every learning rate tried, with or
without the scales, up to ones where uncompressed momentum SGD fell apart (MLP at 1.0, CNN at
0.2, pixels over 16). The scales moved test accuracy by less than the spread over seeds (-0.5 to
+1.1 points).

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
import torch.distributed as dist

from fuelline.trainer.onebit import OneBitState
from fuelline.trainer.onebit_momentum import CompressedMomentum

__all__ = ["OneBitSGD"]


class OneBitSGD(CompressedMomentum):
    """Momentum SGD for ``warmup_steps`` steps, then per-rank momentum and 1-bit update exchange.

    Before the warm-up ends it is ``torch.optim.SGD`` (dampening 0, no Nesterov) on averaged
    gradients. Weight decay is added to the gradient, as ``torch.optim.SGD`` does.

    From ``warmup_steps`` on, ``p.grad`` holds this rank's local gradient when :meth:`step` runs
    and each rank's ``momentum_buffer`` is its own; the parameters stay identical on all ranks.
    Each step then exchanges the update in 1 bit, each tensor divided by its own scale, and the
    scales (one float per tensor) in fp32.

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
        scales = self._tensor_scales(views)
        if scales is not None:
            # A tensor of scale 0 is zero on every rank: dividing it by 1 leaves it so, and
            # multiplying what it decodes to by 0 leaves it where it is.
            for view, divisor in zip(views, torch.where(scales > 0, scales, 1.0).unbind()):
                view.div_(divisor)
        self._exchange(flat)
        if scales is not None:
            for view, scale in zip(views, scales.unbind()):
                view.mul_(scale)
        for (_, p), view in zip(tracked, views):
            p.sub_(view)

    def _tensor_scales(self, views: list[torch.Tensor]) -> torch.Tensor | None:
        """Each tensor's mean update magnitude, averaged over the ranks (see the module's design
        note "per-tensor scales"); None on one rank, where nothing is compressed."""
        state = self.onebit_state
        world_size = state.world_size
        if world_size == 1:
            return None
        scales = torch.stack([view.abs().sum() / max(1, view.numel()) for view in views])
        dist.all_reduce(scales, group=state.group)
        # Counted as fp32_allreduce counts a ring's bytes; they are not gradient elements.
        state.bytes_sent += 2 * (world_size - 1) * -(-len(views) // world_size) * scales.element_size()
        return scales.div_(world_size)
