"""Gradient communication: the DDP hook for ``--compression`` and the bytes it sends.

Every hook counts what this rank hands to collectives, so the trainer can report gradient bytes
sent per element for none, fp16 and onebit alike. For the uncompressed hooks a ring all-reduce of
n elements of b bytes sends 2·(W−1)/W·n·b bytes per rank; that is what is counted.
"""

# No ``from __future__ import annotations`` here: DDP checks that a hook's ``bucket`` parameter is
# annotated with the GradBucket class itself, not a string.
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from fuelline.trainer.onebit import OneBitState

__all__ = ["CountingState", "allreduce_hook", "fp16_hook", "register"]


@dataclass
class CountingState:
    """Bytes sent and elements reduced by this rank (for the uncompressed hooks)."""

    process_group: Optional[dist.ProcessGroup] = None
    bytes_sent: int = 0
    elements: int = 0

    @property
    def bytes_per_element(self) -> float:
        return self.bytes_sent / self.elements if self.elements else 0.0


def _ring_bytes(n: int, itemsize: int, world: int) -> int:
    return 2 * (world - 1) * n * itemsize // world


def allreduce_hook(state: CountingState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default (an fp32 all-reduce, averaged), counted."""
    group = state.process_group
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    state.bytes_sent += _ring_bytes(buf.numel(), buf.element_size(), world)
    state.elements += buf.numel()
    return dist.all_reduce(buf.div_(world), group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def fp16_hook(state: CountingState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Gradients cast to fp16 for the all-reduce (as torch's fp16_compress_hook), counted."""
    group = state.process_group
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    half = buf.to(torch.float16).div_(world)
    state.bytes_sent += _ring_bytes(half.numel(), half.element_size(), world)
    state.elements += buf.numel()

    def back(fut: torch.futures.Future) -> torch.Tensor:
        buf.copy_(fut.value()[0])
        return buf

    return dist.all_reduce(half, group=group, async_op=True).get_future().then(back)


def register(
    ddp: torch.nn.parallel.DistributedDataParallel, compression: str, warmup_iters: int = 10
) -> Union[CountingState, "OneBitState"]:
    """Register the hook for ``compression``; returns the state whose byte counters to report."""
    if compression == "none":
        state = CountingState()
        ddp.register_comm_hook(state, allreduce_hook)
    elif compression == "fp16":
        state = CountingState()
        ddp.register_comm_hook(state, fp16_hook)
    elif compression == "onebit":
        from fuelline.trainer.onebit import OneBitState, onebit_hook

        onebit = OneBitState(warmup_iters=warmup_iters)
        onebit.name_parameters(ddp.module)  # error buffers that outlive bucket rebuilds and resumes
        ddp.register_comm_hook(onebit, onebit_hook)
        return onebit
    else:
        raise ValueError(f"--compression must be none, fp16 or onebit, got {compression!r}")
    return state
