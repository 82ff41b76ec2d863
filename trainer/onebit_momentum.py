"""Optimizers whose momentum, not gradient, crosses the ranks in 1-bit form.

Design note "why the momentum". Error feedback delivers every bit of a compressed gradient, but
part of it some steps late. An optimizer that keeps a momentum of the delivered gradients then
applies each late part for many steps (heavy-ball SGD: ``1 / (1 - beta)`` times as long, ten
times at 0.9), the delays pile up in the error buffers, and training falls behind or blows up
late. Adam is worse off: its variance, made from the compressed gradients, is wrong in a way
error feedback cannot undo. Compressing the momentum instead keeps the compression error in the
units of one step's update, where error feedback owes it only once.

:class:`CompressedMomentum` holds what both 1-bit optimizers share:

* a warm-up of ``warmup_steps`` plain steps on gradients averaged by :func:`momentum_hook` with a
  fp32 all-reduce (the first, largest and least regular gradients, where compression hurts most);
* from then on the hook communicates nothing and hands DDP the local gradients, and the
  optimizer averages one flat vector per step with
  :func:`fuelline.trainer.onebit.onebit_allreduce` (two-phase 1-bit exchange, send and reduce
  error feedback) under one fixed key, so DDP's bucket rebuilds do not matter and the error
  buffers are saved and restored with the hook's state;
* its step count in the optimizer's state dict, so a resumed run does not warm up again.

The averaged vector is decoded from the same bytes on every rank, so parameters stay
bit-identical across ranks. The two optimizers, :class:`~fuelline.trainer.onebit_adam.OneBitAdam`
and :class:`~fuelline.trainer.onebit_sgd.OneBitSGD`, differ in what that vector is.
"""

# No ``from __future__ import annotations``: DDP compares a hook's annotations with the
# GradBucket and Future classes themselves.
import abc
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fuelline.trainer.onebit import OneBitState, exchange_buffer, fp32_allreduce, onebit_allreduce

__all__ = ["CompressedMomentum", "momentum_hook", "register_momentum_hook"]

logger = logging.getLogger(__name__)


def momentum_hook(state: OneBitState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook for a :class:`CompressedMomentum` optimizer: fp32 average while it warms up,
    the local gradients after."""
    buffer = bucket.buffer()
    if state.local_gradients:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    return fp32_allreduce(state, buffer)


def register_momentum_hook(
    ddp: DistributedDataParallel, state: OneBitState | None = None
) -> OneBitState:
    """Register :func:`momentum_hook` on ``ddp``; returns the state to give the optimizer.

    Raises:
        TypeError: ``state`` is not a :class:`~fuelline.trainer.onebit.OneBitState`.
    """
    if state is None:
        state = OneBitState(process_group=ddp.process_group)
    elif not isinstance(state, OneBitState):
        # Caught here, not as an AttributeError inside the backward pass.
        raise TypeError(f"state must be a OneBitState or None, got {type(state).__name__}")
    state.payload = "momentum"
    ddp.register_comm_hook(state, momentum_hook)
    return state


class CompressedMomentum(torch.optim.Optimizer, abc.ABC):
    """Base of the 1-bit optimizers: warm-up, phase switch, exchange and saved step count.

    Subclasses implement :meth:`_warmup_step` (on averaged gradients) and
    :meth:`_compressed_step` (on local gradients, calling :meth:`_exchange` once).

    Args:
        params: parameters or parameter groups.
        defaults: the per-group hyperparameters.
        warmup_steps: plain steps before the exchange is compressed.
        state: the state shared with :func:`momentum_hook` on the DDP model.
        error_decay: each step, the error-feedback buffers are multiplied by this. 1.0 owes
            every bit of the compression error until it is delivered; below 1 an error that the
            signs keep failing to deliver fades instead of growing (see :class:`OneBitSGD`).
    """

    #: The error-feedback key of the exchanged vector (a string: saved with the hook's state).
    exchange_key = "onebit.momentum"

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        warmup_steps: int,
        state: OneBitState | None,
        error_decay: float = 1.0,
    ) -> None:
        if not 0.0 <= error_decay <= 1.0:
            raise ValueError(f"error_decay must be in [0, 1], got {error_decay}")
        super().__init__(params, defaults)
        self.warmup_steps = warmup_steps
        self.error_decay = error_decay
        self.onebit_state = state if state is not None else OneBitState()
        self.onebit_state.payload = "momentum"
        # Steps taken; decides the phase, so it is saved with the optimizer.
        self.steps = 0
        self._sync_hook()

    def _sync_hook(self) -> None:
        # The hook runs during the backward pass of the next step, so it must already know
        # which phase that step is in.
        self.onebit_state.local_gradients = self.steps >= self.warmup_steps

    def state_dict(self) -> dict[str, Any]:
        state_dict = super().state_dict()
        state_dict["onebit_steps"] = self.steps
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.steps = int(state_dict.pop("onebit_steps", 0))
        super().load_state_dict(state_dict)
        self._sync_hook()

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.steps < self.warmup_steps:
            self._warmup_step()
        else:
            if self.steps == self.warmup_steps:
                logger.info("1-bit compression starts after %s iterations", self.steps)
            self._compressed_step()
        self.steps += 1
        self._sync_hook()
        return loss

    def _exchange_buffer(self, n: int, device: torch.device) -> torch.Tensor:
        """Where to write the ``n`` values of this step's exchange (no copy in or out)."""
        return exchange_buffer(self.onebit_state, self.exchange_key, n, device)

    def _exchange(self, flat: torch.Tensor) -> None:
        """Average ``flat`` (the same size on every rank) in place, in 1-bit form."""
        state = self.onebit_state
        onebit_allreduce(state, flat, key=self.exchange_key).wait()
        if self.error_decay != 1.0:
            for errors in (state.send_errors, state.reduce_errors):
                buffer = errors.get(self.exchange_key)
                if buffer is not None:
                    buffer.mul_(self.error_decay)

    @abc.abstractmethod
    def _warmup_step(self) -> None:
        ...

    @abc.abstractmethod
    def _compressed_step(self) -> None:
        ...
