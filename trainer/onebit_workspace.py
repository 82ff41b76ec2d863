"""The scratch buffers of the 1-bit exchange, kept per key from call to call.

:func:`fuelline.trainer.onebit.onebit_allreduce` corrects, compresses, decodes and averages a
vector in several steps, each of the vector's size. Allocating those buffers on every call cost
more than the work itself on a CPU (a fresh allocation that large is mapped, faulted in page by
page and unmapped again), so each key (a bucket, an optimizer's exchanged vector) keeps a
:class:`Workspace`: about ``3 * W * C`` floats beside its error buffers, made again only when the
vector's size, the world size, the block size or the device changes.
:func:`fuelline.trainer.onebit.exchange_buffer` hands a caller the workspace's input vector, so
it can write its values where the exchange corrects them and read the average back from there.
"""

from __future__ import annotations

from collections.abc import Hashable, MutableMapping
from typing import Any

import torch

from fuelline.trainer.bitpack import block_counts

__all__ = ["Shape", "Workspace", "exchange_shape", "workspace"]

# (elements, world size, chunk length, block size, message bytes, device)
Shape = tuple[int, int, int, int, int, torch.device]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def exchange_shape(n: int, world_size: int, block_size: int, device: torch.device) -> Shape:
    """How an exchange of ``n`` elements is laid out: ``W`` equal chunks of whole sign bytes (at
    least one byte each, so no collective is ever empty), and per chunk a message of its sign
    bytes and the bytes of its block scales."""
    chunk_len = 8 * max(1, _ceil_div(n, 8 * world_size))
    message_bytes = chunk_len // 8 + 4 * _ceil_div(chunk_len, block_size)
    return n, world_size, chunk_len, block_size, message_bytes, device


class Workspace:
    """The buffers of one key's exchange (see the module's docstring)."""

    __slots__ = ("shape", "lengths", "counts", "corrected", "magnitudes", "negative", "decoded",
                 "send", "received", "own", "average", "gathered")

    def __init__(self, shape: Shape) -> None:
        n, world_size, chunk_len, block_size, message_bytes, device = shape
        self.shape = shape
        total = world_size * chunk_len
        self.lengths = (n - torch.arange(world_size, device=device) * chunk_len).clamp(0, chunk_len)
        self.counts = block_counts(self.lengths, chunk_len, block_size)
        # Its padding (past n) is never written, so it stays zero.
        self.corrected = torch.zeros(total, dtype=torch.float32, device=device)
        self.magnitudes = torch.empty(total, dtype=torch.float32, device=device)
        self.negative = torch.empty(total, dtype=torch.bool, device=device)
        # The send side's decoded chunks, then the received versions, then the gathered average.
        self.decoded = torch.empty(total, dtype=torch.float32, device=device)
        self.send = torch.empty(world_size, message_bytes, dtype=torch.uint8, device=device)
        self.received = torch.empty_like(self.send)
        self.own = torch.empty(message_bytes, dtype=torch.uint8, device=device)
        self.average = torch.empty(chunk_len, dtype=torch.float32, device=device)
        self.gathered = torch.empty(world_size * message_bytes, dtype=torch.uint8, device=device)


def workspace(spaces: MutableMapping[Hashable, Any], key: Hashable, shape: Shape) -> Workspace:
    """``key``'s workspace in ``spaces``, made again if it was made for another shape."""
    space = spaces.get(key)
    if space is None or space.shape != shape:
        space = spaces[key] = Workspace(shape)
    return space
