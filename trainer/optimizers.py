"""Which optimizer the trainer's options ask for, and whether it exchanges its momentum in 1 bit.

The 1-bit optimizers (``onebit_sgd``, ``onebit_adam``) share ``onebit_momentum``'s base; choosing
between them lives here, above both, so none of the three imports another's subclass.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from fuelline.trainer.onebit import OneBitState
from fuelline.trainer.onebit_adam import OneBitAdam
from fuelline.trainer.onebit_momentum import CompressedMomentum
from fuelline.trainer.onebit_sgd import OneBitSGD

__all__ = ["exchanges_momentum", "make_optimizer", "onebit_optimizer"]


def exchanges_momentum(optimizer: str, compression: str, momentum: float = 0.9) -> bool:
    """Whether the trainer's ``--optimizer``, ``--compression`` and ``--momentum`` make an
    optimizer exchange its momentum in 1 bit. SGD without momentum has none to exchange: its
    gradients go through :func:`~fuelline.trainer.onebit.onebit_hook`, where error feedback's
    delays cost nothing that a momentum would repeat (measured: it keeps the accuracy of plain
    SGD, where the decaying error feedback of :class:`~fuelline.trainer.onebit_sgd.OneBitSGD`
    did not)."""
    if optimizer == "onebit-adam":
        return True
    return compression == "onebit" and (optimizer == "adam" or (optimizer == "sgd" and momentum > 0))


def onebit_optimizer(args: Any, params: Iterable[torch.Tensor], state: OneBitState) -> CompressedMomentum:
    """The trainer's 1-bit optimizer for its options (``args``: the parsed command line):
    :class:`~fuelline.trainer.onebit_sgd.OneBitSGD` after ``--warmup-iters`` plain steps for sgd,
    :class:`~fuelline.trainer.onebit_adam.OneBitAdam` frozen at ``--freeze-step`` for adam."""
    if args.optimizer == "sgd":
        return OneBitSGD(params, lr=args.lr, momentum=args.momentum, warmup_steps=args.warmup_iters, state=state)
    return OneBitAdam(params, lr=args.lr, freeze_step=args.freeze_step, state=state)


def make_optimizer(args, ddp: DDP, comm_state: Any) -> torch.optim.Optimizer:
    """The optimizer ``--optimizer``, ``--compression`` and ``--momentum`` ask for, over ``ddp``'s
    parameters; a 1-bit one shares ``comm_state`` with the DDP hook."""
    params = ddp.parameters()
    if exchanges_momentum(args.optimizer, args.compression, args.momentum):  # the optimizer compresses its momentum
        return onebit_optimizer(args, params, comm_state)
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    return torch.optim.Adam(params, lr=args.lr)
