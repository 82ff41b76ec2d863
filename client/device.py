"""Device prefetch for ``ServerDataStream(..., device=, pin_memory=)``: batches handed over as torch
tensors already where the caller computes on them. Torch is imported only when these are asked for.

One batch ahead. With a device, the stream takes batch k+1 from its connection as soon as it has
arrived, before it hands batch k over, and starts its copy (``stage``): on a CUDA device the copy
is queued on a side stream, so it runs while the caller's kernels train on batch k. A batch taken
ahead is not a batch received: the stream's position counts only batches handed to the caller, so
a state saved, or a stream pickled, with a batch ahead resumes at that batch. The stream then holds
at most one batch more than ``hwm``.

Handing over (``hand_over``) makes the caller's current stream wait for the batch's copy (an event
recorded after it, rather than the whole side stream, which may already be copying the next batch)
and records every tensor on the current stream, so that the caching allocator, which allocated it
on the side stream, does not give its memory away while the caller's kernels may still read it.

Pinned buffers. A copy to the device is asynchronous only from page-locked (pinned) host memory,
and pinning is slow (the pages are locked one allocation at a time), so with ``pin_memory=True``
a batch is copied into reusable pinned buffers, a few per (source, shape, dtype), and from there to
the device. A buffer is reused only once the copy out of it has completed (an event per buffer).
On the CPU (``device="cpu"``, or ``pin_memory=True`` alone) the tensors handed over are pinned
ones, for the caller's own ``.to(device, non_blocking=True)``: fresh each batch, since the caller
keeps them.

Where it cannot work it says so at construction: ``device="cuda"`` without CUDA raises
``ValueError``, and so does ``pin_memory=True`` where torch cannot pin host memory (no CUDA or other
accelerator): a silent fallback would leave every copy synchronous without anyone knowing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["DevicePlacement", "device_placement"]

BUFFERS_PER_KEY = 4  # pinned buffers per (source, shape, dtype): one batch in copy, one ahead, slack
MAX_KEYS = 64  # (source, shape, dtype) keys kept; a stream of ever-changing shapes evicts the oldest


def device_placement(device: Any, pin_memory: bool, tensors: bool = False) -> DevicePlacement | None:
    """Check ``ServerDataStream``'s ``device`` and ``pin_memory`` and build what places its batches.

    Args:
        device: None, a device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``), a ``torch.device`` or
            a CUDA device index. A bare ``"cuda"`` means the current CUDA device when the first
            batch is placed (after ``torch.cuda.set_device`` in a DDP rank).
        pin_memory: place batches in pinned host memory on their way (see the module's docstring).
        tensors: where neither is asked for, hand over CPU tensors on the received memory.

    Returns:
        None where none of them is asked for: numpy arrays are handed over.

    Raises:
        ValueError: not a torch device, a device other than the CPU or CUDA, CUDA where this host
            has none (or not that many GPUs), or ``pin_memory=True`` where torch cannot pin memory.
            The message names the argument and what to pass instead.
    """
    if device is None and not pin_memory:
        if not tensors:
            return None
        import torch  # (an ImportError where it is missing, as always)

        return DevicePlacement(torch.device("cpu"), False, ahead=False)
    if type(pin_memory) is not bool:
        raise ValueError(f"pin_memory must be True or False, got {pin_memory!r}")
    try:
        import torch
    except ImportError:
        raise ValueError(f"device={device!r}, pin_memory={pin_memory!r} need torch, which is not installed "
                         "(pip install 'fuelline[trainer]')") from None
    target = _parse(device)
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r}: CUDA is not available on this host (torch.cuda.is_available() is False; "
                f"torch {torch.__version__}); pass device='cpu' or None, or run on a host with a CUDA GPU")
        if target.index is not None and target.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: this host has {torch.cuda.device_count()} CUDA device(s); "
                             "pass 'cuda' (the current one) or an index below that")
    elif target.type != "cpu":
        raise ValueError(f"device={device!r}: only 'cpu' and CUDA devices are supported")
    if pin_memory and not torch.cuda.is_available():
        try:
            torch.empty(1).pin_memory()
        except RuntimeError as exc:
            raise ValueError(f"pin_memory=True: torch cannot pin host memory on this host ({exc}); "
                             "pass pin_memory=False") from None
    return DevicePlacement(target, pin_memory, ahead=True)


def _parse(device: Any) -> torch.device:
    import torch

    if device is None:
        return torch.device("cpu")
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, (str, int)) or isinstance(device, bool):
        raise ValueError(f"device must be a device string, a torch.device or a CUDA index, got {device!r}")
    try:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"device={device!r} is not a torch device ({exc})") from None


@dataclass
class _Staged:
    """A batch on its way to a CUDA device: its tensors there, the event after its copy, and the
    host tensors it is copied from (kept alive until then)."""

    tensors: dict[str, torch.Tensor]
    copied: torch.cuda.Event
    host: dict[str, torch.Tensor]


class DevicePlacement:
    """Places a stream's batches: ``stage`` when a batch is taken, ``hand_over`` when the caller gets
    it. Made by ``device_placement``; one per stream, used by the caller's thread only.

    Attributes:
        device: where batches are handed over.
        pin_memory: whether they go through pinned host memory.
        ahead: whether the stream takes a batch ahead (a device or pinned memory was asked for;
            not for plain ``tensors=True``, which only wraps the received memory).
        staged: batches staged so far.
        staged_ahead: of those, batches taken while the previous one was still to be handed over.
        pinned: pinned buffers allocated so far (reused ones count once).
    """

    def __init__(self, device: torch.device, pin_memory: bool, ahead: bool) -> None:
        self.device = device
        self.pin_memory = pin_memory
        self.ahead = ahead
        self.staged = 0
        self.staged_ahead = 0
        self.pinned = 0
        self._side: torch.cuda.Stream | None = None
        # (source, shape, dtype) -> [(buffer, event after the copy out of it, or None)]
        self._pool: OrderedDict[tuple, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = OrderedDict()

    def stage(self, arrays: Mapping[str, np.ndarray], ahead: bool = False) -> Any:
        """Start placing a batch just taken from the connection; ``ahead``: the previous batch has
        not been handed over yet."""
        import torch

        self.staged += 1
        self.staged_ahead += ahead
        host = {name: torch.from_numpy(a) for name, a in arrays.items()}
        if self.device.type == "cpu":
            return {name: t.pin_memory() for name, t in host.items()} if self.pin_memory else host
        if self._side is None:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._side = torch.cuda.Stream(device=self.device)
        if self.pin_memory:
            host = {name: self._pinned(name, t) for name, t in host.items()}
        with torch.cuda.stream(self._side):
            tensors = {name: t.to(self.device, non_blocking=True) for name, t in host.items()}
            copied = torch.cuda.Event()
            copied.record(self._side)
        if self.pin_memory:
            for name, t in host.items():
                self._release(name, t, copied)
        return _Staged(tensors, copied, host)

    def hand_over(self, staged: Any) -> dict[str, torch.Tensor]:
        """The batch's tensors, ready for the caller's current stream."""
        if not isinstance(staged, _Staged):
            return dict(staged)
        import torch

        current = torch.cuda.current_stream(self.device)
        current.wait_event(staged.copied)
        for t in staged.tensors.values():
            t.record_stream(current)
        return staged.tensors

    def release(self) -> None:
        """Free the pinned buffers (the stream is closed): pinned memory is scarce, the host's own."""
        self._pool.clear()

    # -- the pinned pool (CUDA only) ---------------------------------------------------------------
    def _pinned(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """A pinned buffer of ``src``'s shape and dtype holding a copy of it: a free one of the pool,
        else a new one while the key has fewer than ``BUFFERS_PER_KEY``, else the oldest once its
        copy has completed."""
        import torch

        key = (name, tuple(src.shape), src.dtype)
        buffers = self._pool.setdefault(key, [])
        self._pool.move_to_end(key)
        while len(self._pool) > MAX_KEYS:
            # Dropping a buffer mid-copy is safe: torch's pinned allocator holds its block until
            # the copies that read it have completed.
            self._pool.popitem(last=False)
        for i, (free, copied) in enumerate(buffers):
            if copied is None or copied.query():
                buffer = free
                del buffers[i]
                break
        else:
            if len(buffers) < BUFFERS_PER_KEY:
                buffer = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                self.pinned += 1
            else:
                buffer, copied = buffers.pop(0)
                assert copied is not None
                copied.synchronize()
        buffer.copy_(src)
        return buffer

    def _release(self, name: str, buffer: torch.Tensor, copied: torch.cuda.Event) -> None:
        key = (name, tuple(buffer.shape), buffer.dtype)
        self._pool.setdefault(key, []).append((buffer, copied))
