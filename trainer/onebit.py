"""1-bit compressed all-reduce as a DDP communication hook.

Usage::

    state = OneBitState(process_group=None, warmup_iters=10, block_size=1024)
    ddp_model.register_comm_hook(state, onebit_hook)

Design note "two-phase 1-bit exchange". A ring all-reduce of fp32 gradients sends
``2 * (W - 1) / W * 4`` bytes per element from every rank. Compressing the input of an all-reduce
is not enough, because the partial sums a ring forwards are not 1-bit values. So the exchange is
a reduce-scatter and an all-gather, each carrying 1-bit data, as in 1-bit Adam (Tang et al., 2021):

1. Every rank adds its send error to its bucket (error feedback), pads it to ``W`` equal
   chunks and compresses each chunk (:mod:`fuelline.trainer.bitpack`: signs 8 per byte, one fp32
   scale per block). The send error becomes ``input - decompressed``.
2. Phase 1, ``all_to_all_single``: rank ``r`` receives the ``W`` compressed versions of chunk ``r``.
   It averages them, adds its reduce error for that chunk, compresses the result again and keeps
   ``average - decompressed`` as the new reduce error.
3. Phase 2, ``all_gather``: every rank receives every owned chunk, already averaged, and
   decompresses all of them. Every rank decodes the same bytes with the same operations, so the
   averaged gradients, and hence the parameters, are bit-identical on all ranks.

Both phases send ``(W - 1)`` chunks of ``C / 8 + 4 * ceil(C / block_size)`` bytes for chunks of
``C`` elements, i.e. ``2 * (W - 1) / W * (1/8 + 4 / block_size)`` bytes per element: 1/32 of the
fp32 ring all-reduce plus the scales (3.22 % with ``block_size=1024``) at any world size.

Byte counting (``OneBitState.bytes_sent``) counts what this rank hands to the network, not what it
keeps: phase 1 counts the ``W - 1`` chunks sent to peers (its own chunk stays local), phase 2
counts ``W - 1`` copies of its owned chunk, which is what a ring all-gather sends per rank. A
warm-up fp32 all-reduce counts ``2 * (W - 1) * ceil(n / W) * 4`` bytes, what a ring sends.

The vector is padded only to a multiple of ``8 * W`` elements (whole sign bytes in equal chunks),
not of ``W * block_size``: the last block of a chunk may be short and its scale is the mean over
its real elements. A bucket smaller than ``W * block_size`` therefore costs what its size says.
"""

# No ``from __future__ import annotations``: DDP compares a hook's annotations with the
# GradBucket and Future classes themselves, and a string annotation fails that check.
import logging
from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist

from fuelline.trainer.bitpack import (
    check_block_size,
    compress,
    compress_rows,
    decompress,
    decompress_rows,
    pack_signs,
    unpack_signs,
)
from fuelline.trainer.onebit_layout import Layout, NamedErrors
from fuelline.trainer.onebit_workspace import exchange_shape, workspace

__all__ = [
    "OneBitState",
    "onebit_hook",
    "onebit_allreduce",
    "exchange_buffer",
    "fp32_allreduce",
    "pack_signs",
    "unpack_signs",
    "compress",
    "decompress",
]

logger = logging.getLogger(__name__)

# torch renamed all_gather_into_tensor to all_gather_single; take whichever this torch has.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class OneBitState(NamedErrors):
    r"""Hyperparameters and internal state of :func:`onebit_hook`, shared by all buckets.

    ``warmup_iters`` and ``block_size`` are the knobs a user tunes; keep ``error_feedback`` on.

    1. ``warmup_iters``: iterations of plain fp32 all-reduce before compression starts. It must
       be at least 2 with error feedback, because DDP rebuilds its buckets after the first
       iteration, and an error buffer kept across the rebuild could be added to the gradients of
       other parameters that happen to land in a bucket of the same index and size. The default
       of 10 covers the rebuild with margin and lets the first, largest and least regular
       gradients go through uncompressed, where compression errors hurt most.
    2. ``block_size``: elements sharing one fp32 scale, a multiple of 8. The scales cost
       ``4 / block_size`` bytes per element on top of the 1/8 byte of signs; smaller blocks follow
       the gradient's magnitude more closely.
    3. ``error_feedback``: carry each compression's error into the next round, on the worker and
       on the server side. Without it, sign compression is biased and SGD does not converge to
       the same point; it is an option only to measure that. Error feedback delivers every bit
       of the gradient, but part of it some steps late (the more, the further an element's
       magnitude is from its block's mean), and heavy-ball momentum tolerates delay badly: a
       learning rate close to where fp32 training diverges can diverge with compression.

    Memory: besides the two error buffers (one the size of each key's vector, one a ``1/W``
    share of it), each key keeps the scratch buffers of its exchange, about three times its
    vector's size, so that a step allocates nothing that large (see :mod:`fuelline.trainer.onebit_workspace`).

    Statistics: ``bytes_sent`` and ``elements`` add up over all calls since construction or
    :meth:`reset_stats`; compare :attr:`bytes_per_element` with
    :attr:`ring_allreduce_bytes_per_element` (see :attr:`compression_ratio`).
    """

    __slots__ = [
        "process_group",
        # The fields below are the hyperparameters tuned by the user.
        "warmup_iters",
        "block_size",
        "error_feedback",
        # The fields below are internal state.
        "iter",
        "send_errors",
        "reduce_errors",
        "local_gradients",
        "payload",
        "places",
        "layouts",
        "orders",
        "restored",
        "workspaces",
        # The fields below record communication statistics.
        "bytes_sent",
        "elements",
    ]

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        warmup_iters: int = 10,
        block_size: int = 1024,
        error_feedback: bool = True,
    ) -> None:
        check_block_size(block_size)
        if warmup_iters < 0 or (error_feedback and warmup_iters < 2):
            raise ValueError(
                f"warmup_iters must be >= 2 with error feedback (DDP rebuilds its buckets after "
                f"the first iteration) and >= 0 otherwise, got {warmup_iters}"
            )
        self.process_group = process_group
        self.warmup_iters = warmup_iters
        self.block_size = block_size
        self.error_feedback = error_feedback
        self.iter = 0
        # Keyed by the names of a bucket's parameters (see name_parameters and the design note
        # in fuelline.trainer.onebit_layout), by bucket index without names, or by a caller's
        # key; a buffer whose size no longer matches is replaced by zeros, never reused for a
        # different tensor.
        self.send_errors: dict[Hashable, torch.Tensor] = {}
        self.reduce_errors: dict[Hashable, torch.Tensor] = {}
        # Set by a compressed-momentum optimizer once warm: momentum_hook then leaves gradients
        # local, because the optimizer exchanges its compressed momentum instead.
        self.local_gradients = False
        # What the exchange compresses: "gradients" (this hook), or "momentum" once a
        # compressed-momentum optimizer (fuelline.trainer.onebit_momentum) drives the state.
        self.payload = "gradients"
        # id(parameter) -> (place in the module, name); empty: buckets are keyed by index.
        self.places: dict[int, tuple[int, str]] = {}
        # Per named key, its canonical layout; per DDP bucket order, its key and gather order.
        self.layouts: dict[Hashable, Layout] = {}
        self.orders: dict[tuple[int, ...], tuple[Hashable, torch.Tensor]] = {}
        # Error buffers from a checkpoint, put in place as the buckets they belong to come by.
        self.restored: dict[str, dict[str, Any]] = {}
        # Per key, the scratch buffers of its exchange (onebit_allreduce); never saved.
        self.workspaces: dict[Hashable, Any] = {}
        self.bytes_sent = 0
        self.elements = 0

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the process group, which cannot be pickled (as ``PowerSGDState``), and
        the scratch buffers."""
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot not in ("process_group", "workspaces")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled state on the default process group; set another one afterwards."""
        self.process_group = None
        self.workspaces = {}
        for slot, value in state.items():
            setattr(self, slot, value)

    @property
    def group(self) -> dist.ProcessGroup:
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if group is None:  # (WORLD is None only before init_process_group)
            raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
        return group

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        # Bucket 0 is the last bucket to be reduced in an iteration, so it closes the iteration.
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.warmup_iters:
                logger.info("1-bit compression starts after %s iterations", self.iter)

    def error_buffer(
        self, errors: dict[Hashable, torch.Tensor], key: Hashable, like: torch.Tensor, start: int = 0
    ) -> torch.Tensor:
        """The error buffer for ``key``, zeros if it is new or was made for another size; a new
        one takes what a restored checkpoint holds for it (``start``: the canonical position of
        its first element)."""
        buffer = errors.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.device != like.device:
            buffer = torch.zeros_like(like, dtype=torch.float32)
            errors[key] = buffer
            if self.restored:
                self._restore(errors, key, buffer, start)
        return buffer

    def reset_stats(self) -> None:
        """Restart the byte and element counters (e.g. once warm, to measure compression)."""
        self.bytes_sent = 0
        self.elements = 0

    @property
    def bytes_per_element(self) -> float:
        """Bytes this rank sent per gradient element reduced (0.0 before any)."""
        return self.bytes_sent / self.elements if self.elements else 0.0

    @property
    def ring_allreduce_bytes_per_element(self) -> float:
        """The reference: an fp32 ring all-reduce sends ``2 * (W - 1) / W * 4`` bytes/element."""
        world_size = self.world_size
        return 2.0 * (world_size - 1) / world_size * 4.0

    @property
    def compression_ratio(self) -> float:
        """``bytes_per_element / ring_allreduce_bytes_per_element`` (0.0 if nothing was sent)."""
        reference = self.ring_allreduce_bytes_per_element
        return self.bytes_per_element / reference if reference else 0.0


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def fp32_allreduce(state: OneBitState, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` in place over the group with a plain all-reduce, counting its bytes."""
    world_size = state.world_size
    chunk = _ceil_div(tensor.numel(), world_size)
    state.bytes_sent += 2 * (world_size - 1) * chunk * tensor.element_size()
    state.elements += tensor.numel()
    # Divide first, as fp16_compress_hook does, so low-precision buckets cannot overflow.
    tensor.div_(world_size)
    return (
        dist.all_reduce(tensor, group=state.group, async_op=True)
        .get_future()
        .then(lambda fut: fut.value()[0])
    )


def exchange_buffer(state: OneBitState, key: Hashable, n: int, device: torch.device | None = None) -> torch.Tensor:
    """A float32 vector of ``n`` elements for the values of the next exchange under ``key``:
    a caller that writes them there, then calls ``onebit_allreduce(state, buffer, key)``, saves
    a copy in and a copy out (the average is decoded where the values were)."""
    shape = exchange_shape(n, state.world_size, state.block_size, torch.device("cpu") if device is None else device)
    return workspace(state.workspaces, key, shape).corrected[:n]


def onebit_allreduce(
    state: OneBitState, tensor: torch.Tensor, key: Hashable, order: torch.Tensor | None = None
) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` in place over the group with the two-phase 1-bit exchange.

    Every rank must call this with tensors of the same size, in the same order. Calls with the
    same ``key`` must not overlap: the next may start once the previous one's future is done.

    Args:
        state: hyperparameters, error buffers and byte counters.
        tensor: the local values; overwritten with the (compressed) average.
        key: names the error-feedback buffers (and reused scratch buffers) of this tensor across
            calls (a bucket index, say).
        order: if given, the elements are exchanged in the order ``tensor.view(-1)[order]`` and
            written back in place (a bucket's canonical layout, see :meth:`OneBitState.bucket_key`).

    Returns:
        A future that completes with ``tensor`` once it holds the average.
    """
    group = state.group
    world_size = state.world_size
    if world_size == 1:
        # Nothing to exchange, and compressing would only add error.
        return _completed(tensor)
    rank = dist.get_rank(group)
    block_size = state.block_size
    n = tensor.numel()
    shape = exchange_shape(n, world_size, block_size, tensor.device)
    _, _, chunk_len, _, message_bytes, _ = shape
    sign_bytes = chunk_len // 8
    space = workspace(state.workspaces, key, shape)

    corrected = space.corrected
    flat = tensor.reshape(-1)
    # A caller that filled exchange_buffer() already wrote its values where they are corrected.
    in_place = order is None and flat.data_ptr() == corrected.data_ptr() and flat.is_contiguous()
    if not in_place:
        if order is None:
            corrected[:n].copy_(flat)
        else:
            torch.index_select(flat, 0, order, out=corrected[:n])
    if state.error_feedback:
        send_error = state.error_buffer(state.send_errors, key, corrected[:n])
        corrected[:n].add_(send_error)
    rows = corrected.view(world_size, chunk_len)
    packed, scales = compress_rows(rows, block_size, space.counts, space.magnitudes, space.negative)
    if state.error_feedback:
        decoded = decompress_rows(packed, scales, chunk_len, block_size, space.decoded).view(-1)
        torch.sub(corrected[:n], decoded[:n], out=send_error)

    # One message per destination: its chunk's sign bytes followed by the bytes of its scales.
    send, received = space.send, space.received
    send[:, :sign_bytes].copy_(packed)
    send[:, sign_bytes:].copy_(scales.view(torch.uint8))
    # Phase 1 waits here, in the thread that called the hook, on purpose: gloo completes futures
    # on its own worker threads, so a phase-2 collective issued from a callback could be enqueued
    # before the next bucket's phase 1 on one rank and after it on another, and the ranks would
    # pair up different collectives. Issuing every collective from the hook keeps DDP's bucket
    # order on all ranks; phase 2 still overlaps with the rest of the backward pass.
    dist.all_to_all_single(received, send, group=group)

    versions = decompress_rows(
        received[:, :sign_bytes],
        received[:, sign_bytes:].contiguous().view(torch.float32),
        chunk_len,
        block_size,
        space.decoded,
    )
    own_len = int(space.lengths[rank])
    average = torch.sum(versions, dim=0, out=space.average).div_(world_size)
    # Padding decodes to ±scale; zero it so it neither enters the scales nor the reduce error.
    average[own_len:] = 0
    if state.error_feedback:
        reduce_error = state.error_buffer(state.reduce_errors, key, average, start=rank * chunk_len)
        average.add_(reduce_error)
    own_counts = space.counts[rank : rank + 1]
    own_packed, own_scales = compress_rows(
        average.view(1, chunk_len), block_size, own_counts,
        space.magnitudes[:chunk_len], space.negative[:chunk_len],
    )
    if state.error_feedback:
        decoded_own = decompress_rows(own_packed, own_scales, chunk_len, block_size,
                                      space.decoded[:chunk_len]).view(-1)
        torch.sub(average, decoded_own, out=reduce_error)
        reduce_error[own_len:] = 0

    own_message, gathered = space.own, space.gathered
    own_message[:sign_bytes].copy_(own_packed.view(-1))
    own_message[sign_bytes:].copy_(own_scales.view(torch.uint8).view(-1))
    fut = _all_gather_single(gathered, own_message, group=group, async_op=True).get_future()
    # Phase 1 sends W - 1 messages to peers, phase 2 sends W - 1 copies of the owned one.
    state.bytes_sent += 2 * (world_size - 1) * message_bytes
    state.elements += n

    def decode(_: torch.futures.Future[Any]) -> torch.Tensor:
        rows = gathered.view(world_size, message_bytes)
        result = decompress_rows(
            rows[:, :sign_bytes],
            rows[:, sign_bytes:].contiguous().view(torch.float32),
            chunk_len,
            block_size,
            corrected if in_place else space.decoded,
        )
        if in_place:
            corrected[n:] = 0  # padding decodes to ±scale; the next call needs zeros there
        elif order is None:
            flat.copy_(result.view(-1)[:n])
            if flat.data_ptr() != tensor.data_ptr():  # (a reshape that copied)
                tensor.copy_(flat.view_as(tensor))
        else:
            tensor.view(-1).index_copy_(0, order, result.view(-1)[:n])
        return tensor

    return fut.then(decode)


def onebit_hook(state: OneBitState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: 1-bit compressed gradient averaging with error feedback.

    The first ``state.warmup_iters`` iterations use a plain fp32 all-reduce; after that each
    bucket goes through :func:`onebit_allreduce`, keyed by its index, and is written back into
    the bucket's buffer (which may be a view of the gradients). With parameter names
    (:meth:`OneBitState.name_parameters`) it is exchanged in its canonical layout and keyed by
    those names instead.

    Example::
        >>> state = OneBitState(process_group=None, warmup_iters=10)
        >>> ddp_model.register_comm_hook(state, onebit_hook)
    """
    buffer = bucket.buffer()
    if state.iter < state.warmup_iters:
        state.maybe_increase_iter(bucket)
        return fp32_allreduce(state, buffer)
    key, order = state.bucket_key(bucket)
    fut = onebit_allreduce(state, buffer, key=key, order=order)
    state.maybe_increase_iter(bucket)
    return fut
