"""Error-feedback buffers keyed by parameter names, so they survive bucket rebuilds and resumes.

Design note "canonical bucket layout". DDP lays a bucket out in one order for its first iteration
and rebuilds it after that in the order the gradients became ready, and a resumed run builds a
new DDP that goes through the same again. A buffer keyed by bucket index would then meet other
elements. So :func:`~fuelline.trainer.onebit.onebit_hook` compresses each bucket in a canonical
order, its parameters sorted by their place in the module, and keys its buffers by the names of
those parameters in that order: the same set of parameters is the same key and the same layout,
whatever order DDP put them in. A checkpoint splits the buffers up per parameter
(:func:`errors_state`), and a resumed run puts each parameter's part back wherever its new
bucket places it (:func:`restore_into`); parts no bucket asks for are dropped.

The send error covers a whole bucket; the reduce error only the chunk this rank owns
(``[rank * chunk, (rank + 1) * chunk)`` of the canonical layout), so per parameter it is a slice,
saved with its offset. It is per rank: it applies only at the same rank of the same world size.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["Layout", "NamedErrors", "bucket_layout", "errors_state", "restore_into"]

# A bucket's canonical layout: (name, elements) of its parameters, in canonical order.
Layout = tuple[tuple[str, int], ...]


def bucket_layout(
    params: Iterable[torch.Tensor], places: Mapping[int, tuple[int, str]]
) -> tuple[tuple[str, ...], Layout, torch.Tensor] | None:
    """The key, layout and gather order of a bucket holding ``params`` (in DDP's order).

    Args:
        params: the bucket's parameters, as ``GradBucket.parameters()`` gives them.
        places: ``id(parameter) -> (place in the module, name)``.

    Returns:
        ``(key, layout, order)``: ``canonical = flat[order]`` for the bucket's flat buffer; or
        None if some parameter has no name (the caller keys by bucket index then).
    """
    entries, offset = [], 0
    for p in params:
        place = places.get(id(p))
        if place is None:
            return None
        entries.append((place[0], place[1], p.numel(), offset))
        offset += p.numel()
    entries.sort()
    order = torch.cat([torch.arange(start, start + n) for _, _, n, start in entries])
    layout = tuple((name, n) for _, name, n, _ in entries)
    return tuple(name for name, _ in layout), layout, order


def errors_state(
    worker: Mapping[Hashable, torch.Tensor],
    server: Mapping[Hashable, torch.Tensor],
    layouts: Mapping[Hashable, Layout],
    rank: int,
) -> dict[str, Any]:
    """The buffers as plain data: per parameter for named layouts, as they are for string keys
    (a caller's own fixed-layout vector, e.g. 1-bit Adam's momentum). Bucket-index keys are left
    out: they mean nothing to another DDP. ``worker`` are the send errors and ``server`` the
    reduce errors; a checkpoint keeps the 1-bit Adam paper's names for them, so saved states load
    across versions."""
    per_worker: dict[str, torch.Tensor] = {}
    per_server: dict[str, list[Any]] = {}
    keyed: dict[str, dict[str, torch.Tensor]] = {}
    for key, layout in layouts.items():
        offset = 0
        own = server.get(key)
        start = rank * own.numel() if own is not None else 0
        for name, n in layout:
            if key in worker:
                per_worker[name] = worker[key][offset : offset + n].detach().cpu().clone()
            if own is not None:
                lo, hi = max(offset, start), min(offset + n, start + own.numel())
                if lo < hi:
                    per_server[name] = [lo - offset, own[lo - start : hi - start].detach().cpu().clone()]
            offset += n
    for errors, kind in ((worker, "worker"), (server, "server")):
        for key, buffer in errors.items():
            if isinstance(key, str):
                keyed.setdefault(key, {})[kind] = buffer.detach().cpu().clone()
    return {"worker": per_worker, "server": per_server, "keyed": keyed}


def restore_into(buffer: torch.Tensor, layout: Layout, saved: Mapping[str, Any], start: int, server: bool) -> None:
    """Fill ``buffer`` (zeros, covering canonical positions ``start`` on) from the per-parameter
    parts in ``saved`` that fall in it; the parts used are taken out of ``saved``."""
    offset = 0
    for name, n in layout:
        part = saved.pop(name, None) if isinstance(saved, dict) else None
        if part is not None:
            first, values = (int(part[0]), part[1]) if server else (0, part)
            lo = offset + first - start
            lo_clip, hi = max(lo, 0), min(lo + values.numel(), buffer.numel())
            if lo_clip < hi and first + values.numel() <= n:
                buffer[lo_clip:hi] = values[lo_clip - lo : hi - lo].to(buffer.device, buffer.dtype)
        offset += n


class _ErrorState(Protocol):
    """The state :class:`NamedErrors` works on: the fields of
    :class:`~fuelline.trainer.onebit.OneBitState` (which keeps them in its own slots, the
    ones it pickles) that its methods use."""

    iter: int
    send_errors: dict[Hashable, torch.Tensor]
    reduce_errors: dict[Hashable, torch.Tensor]
    places: dict[int, tuple[int, str]]
    layouts: dict[Hashable, Layout]
    orders: dict[tuple[int, ...], tuple[Hashable, torch.Tensor]]
    restored: dict[str, dict[str, Any]]
    bytes_sent: int
    elements: int

    @property
    def group(self) -> dist.ProcessGroup: ...

    @property
    def world_size(self) -> int: ...


class NamedErrors:
    """What :class:`~fuelline.trainer.onebit.OneBitState` does with parameter names: key its
    buckets canonically, and save and restore its counters and error buffers."""

    __slots__ = ()

    def name_parameters(self: _ErrorState, module: torch.nn.Module) -> None:
        """Key the error buffers of :func:`onebit_hook` by the names of ``module``'s parameters
        (the module DDP wraps), so that they survive bucket rebuilds and checkpoints."""
        self.places = {id(p): (i, name) for i, (name, p) in enumerate(module.named_parameters())}
        self.orders.clear()

    def bucket_key(self: _ErrorState, bucket: dist.GradBucket) -> tuple[Hashable, torch.Tensor | None]:
        """The error-feedback key of ``bucket`` and the order that lays it out canonically
        (None: as it is, keyed by bucket index, when the parameters have no names)."""
        params = bucket.parameters()
        ids = tuple(id(p) for p in params)
        if ids not in self.orders:
            found = bucket_layout(params, self.places) if self.places else None
            if found is None:
                return bucket.index(), None
            key, layout, order = found
            self.layouts[key] = layout
            self.orders[ids] = (key, order.to(bucket.buffer().device))
        return self.orders[ids]

    def state_dict(self: _ErrorState) -> dict[str, Any]:
        """Counters, iteration count and error buffers, for a checkpoint, as plain data.

        The buffers are saved per parameter name (buckets keyed by index are left out), the
        reduce errors with this rank's place: they apply to a resume at the same world size.
        """
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        world = self.world_size if dist.is_initialized() else 1
        return {
            "bytes_sent": self.bytes_sent,
            "elements": self.elements,
            "iter": self.iter,
            "rank": rank,
            "world_size": world,
            "errors": errors_state(self.send_errors, self.reduce_errors, self.layouts, rank),
        }

    def load_state_dict(self: _ErrorState, state_dict: dict[str, Any], buffers: bool = True) -> None:
        """Restore counters and iteration count (a warm-up done stays done) and, with
        ``buffers``, the error buffers, which are put in place as their buckets come by.

        Args:
            state_dict: from :meth:`state_dict`.
            buffers: False when resuming on another world size, where this rank's error
                buffers (its share of the error, its owned chunk) no longer apply.
        """
        self.bytes_sent = int(state_dict["bytes_sent"])
        self.elements = int(state_dict["elements"])
        self.iter = int(state_dict.get("iter", 0))
        self.send_errors.clear()
        self.reduce_errors.clear()
        errors = state_dict.get("errors")
        self.restored = {}
        if buffers and errors:
            self.restored = {kind: dict(errors[kind]) for kind in ("worker", "server", "keyed")}

    def _restore(self: _ErrorState, errors: dict[Hashable, torch.Tensor], key: Hashable, buffer: torch.Tensor, start: int) -> None:
        kind = "server" if errors is self.reduce_errors else "worker"
        saved = self.restored["keyed"].get(key, {}).pop(kind, None) if isinstance(key, str) else None
        if saved is not None and saved.numel() == buffer.numel():
            buffer.copy_(saved.view_as(buffer))
        elif key in self.layouts:
            restore_into(buffer, self.layouts[key], self.restored[kind], start, server=kind == "server")
