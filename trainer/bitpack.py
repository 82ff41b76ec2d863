"""The 1-bit gradient format: signs packed 8 per byte plus one fp32 scale per block.

A vector ``x`` of ``n`` float elements is sent as

* ``packed``: ``ceil(n / 8)`` uint8 bytes. Element ``8 * j + i`` is bit ``i`` of byte ``j``
  (least significant bit first); a set bit means the element is negative. Zero, ``-0.0`` and NaN
  count as positive, so every element decodes to exactly +1 or -1 and the convention does not
  depend on how a zero was produced.
* ``scales``: ``ceil(n / block_size)`` float32 values, the mean absolute value of each block of
  ``block_size`` consecutive elements (the last block may be shorter). ``scale * sign`` keeps each
  block's L1 norm, which is what makes sign compression with error feedback converge.

``block_size`` must be a multiple of 8 so that a block never shares a byte with the next one.

The all-reduce in :mod:`fuelline.trainer.onebit` compresses a matrix of equal chunks row by row
(:func:`compress_rows` / :func:`decompress_rows`); :func:`compress` and :func:`decompress` are the
same format for one vector. Everything is vectorised on uint8 tensors: no Python loop touches
elements.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "pack_signs",
    "unpack_signs",
    "compress",
    "decompress",
    "compress_rows",
    "decompress_rows",
    "block_counts",
    "block_abs_sums",
    "scale_blocks_",
    "check_block_size",
]

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _shifts(device: torch.device) -> torch.Tensor:
    # Made on the device rather than copied there: no host-to-device transfer per call.
    return torch.arange(8, dtype=torch.uint8, device=device)


# Row b: the eight signs of byte b, least significant bit first, as float32 +1/-1.
_SIGNS_OF_BYTE = 1.0 - 2.0 * np.unpackbits(
    np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"
).astype(np.float32)


def _on_cpu(x: torch.Tensor) -> bool:
    return x.device.type == "cpu"


def check_block_size(block_size: int) -> None:
    """Raise ``ValueError`` unless ``block_size`` is a positive multiple of 8."""
    if not isinstance(block_size, int) or block_size <= 0 or block_size % 8:
        raise ValueError(f"block_size must be a positive multiple of 8, got {block_size!r}")


def pack_signs(x: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Pack the signs of ``x`` (any shape, flattened) into ``ceil(x.numel() / 8)`` bytes.

    Args:
        x: a floating-point tensor.
        scratch: a bool tensor of ``x.numel()`` elements to reuse for the comparison (a caller
            that packs the same size every step saves an allocation).

    Returns:
        A 1-D uint8 tensor on ``x``'s device; bit ``i`` of byte ``j`` is set when element
        ``8 * j + i`` is negative.
    """
    flat = x.detach().reshape(-1)
    negative = flat < 0 if scratch is None else torch.lt(flat, 0, out=scratch.view(-1))
    if _on_cpu(negative):
        # numpy packs bits in one C pass; the tensor path below takes 20x as long on a CPU.
        return torch.from_numpy(np.packbits(negative.numpy(), bitorder="little"))
    return _pack_signs_tensor(negative)


def _pack_signs_tensor(negative: torch.Tensor) -> torch.Tensor:
    """:func:`pack_signs` from a bool tensor with tensor operations only (for any device)."""
    pad = -negative.numel() % 8
    if pad:
        # Padding bits read as "positive" and are dropped again by unpack_signs(packed, n).
        negative = F.pad(negative, (0, pad))
    bits = negative.view(-1, 8).to(torch.uint8)
    # Each bit lands in its own position, so the sum is a bitwise OR and never overflows a byte.
    return (bits << _shifts(bits.device)).sum(dim=1, dtype=torch.uint8)


def _check_packed(packed: torch.Tensor, n: int) -> None:
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed signs must be uint8, got {packed.dtype}")
    if n < 0 or n > 8 * packed.numel():
        raise ValueError(f"cannot unpack {n} signs from {packed.numel()} bytes")


def unpack_signs(packed: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Unpack the first ``n`` signs of ``packed`` as a float32 tensor of +1 and -1.

    Args:
        packed: uint8 sign bytes (any shape: read in row-major order).
        n: signs to unpack.
        out: a contiguous float32 tensor of ``8 * packed.numel()`` elements to write into (all
            of them); the first ``n`` are returned as a view of it.

    Raises:
        ValueError: ``packed`` is not uint8 or holds fewer than ``n`` signs, or ``out`` does not fit.
    """
    _check_packed(packed, n)
    if out is not None and (out.numel() != 8 * packed.numel() or out.dtype != torch.float32
                            or not out.is_contiguous()):
        raise ValueError(f"out must be {8 * packed.numel()} contiguous float32 elements")
    if _on_cpu(packed):
        # One table look-up per byte gives its eight signs.
        index = packed.numpy()
        if out is None:
            signs = torch.from_numpy(np.take(_SIGNS_OF_BYTE, index, axis=0, mode="clip"))
        else:
            np.take(_SIGNS_OF_BYTE, index, axis=0, mode="clip", out=out.numpy().reshape(*index.shape, 8))
            signs = out
        return signs.view(-1)[:n]
    signs = _unpack_signs_tensor(packed, n)
    return signs if out is None else out.view(-1)[:n].copy_(signs)


def _unpack_signs_tensor(packed: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`unpack_signs` with tensor operations only (for any device)."""
    bits = (packed.reshape(-1, 1) >> _shifts(packed.device)) & 1
    return 1.0 - 2.0 * bits.reshape(-1)[:n].to(torch.float32)


def block_counts(lengths: torch.Tensor, row_len: int, block_size: int) -> torch.Tensor:
    """Real (non-padding) elements in each block of each row, as float32 ``[rows, blocks]``.

    Row ``k`` of the padded matrix holds ``lengths[k]`` real elements followed by zeros. A block's
    scale divides by its real count, not by ``block_size``, so padding never shrinks the scale of
    the real elements that share its block.
    """
    n_blocks = _ceil_div(row_len, block_size)
    starts = torch.arange(n_blocks, device=lengths.device) * block_size
    ends = torch.minimum(starts + block_size, lengths.reshape(-1, 1))
    return (ends - starts).clamp_min(0).to(torch.float32)


def block_abs_sums(rows: torch.Tensor, block_size: int, magnitudes: torch.Tensor | None = None) -> torch.Tensor:
    """The sum of absolute values of each block of each row of ``rows`` ``[R, C]``, as
    ``[R, ceil(C / block_size)]`` (the last block of a row may be short). ``magnitudes``: a
    float32 tensor of ``R * C`` elements to reuse for the absolute values."""
    n_rows, row_len = rows.shape
    full = row_len // block_size
    if magnitudes is None:
        magnitudes = rows.abs()
    else:
        magnitudes = torch.abs(rows, out=magnitudes.view(n_rows, row_len))
    sums = magnitudes[:, : full * block_size].reshape(n_rows, full, block_size).sum(dim=2)
    if full * block_size < row_len:
        tail = magnitudes[:, full * block_size :].sum(dim=1, keepdim=True)
        sums = torch.cat([sums, tail], dim=1)
    return sums


def scale_blocks_(values: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """Multiply each block of each row of ``values`` ``[R, C]`` by its scale, in place, without
    expanding the scales to ``C`` elements; returns ``values``."""
    n_rows, row_len = values.shape
    full = row_len // block_size
    if full:
        values[:, : full * block_size].view(n_rows, full, block_size).mul_(scales[:, :full, None])
    if full * block_size < row_len:
        values[:, full * block_size :].mul_(scales[:, full : full + 1])
    return values


def compress_rows(
    rows: torch.Tensor,
    block_size: int,
    counts: torch.Tensor,
    magnitudes: torch.Tensor | None = None,
    negative: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress each row of a float32 ``[R, C]`` matrix (``C`` a multiple of 8) independently.

    Args:
        rows: the matrix; padding elements must be zero.
        block_size: elements per scale; blocks restart at each row.
        counts: ``[R, ceil(C / block_size)]`` real elements per block (see :func:`block_counts`).
        magnitudes, negative: float32 and bool scratch tensors of ``R * C`` elements to reuse.

    Returns:
        ``(packed, scales)``: uint8 ``[R, C // 8]`` and float32 ``[R, ceil(C / block_size)]``.
    """
    n_rows, row_len = rows.shape
    # clamp: an all-padding block has sum 0 and gets scale 0 instead of 0/0.
    scales = block_abs_sums(rows, block_size, magnitudes).div_(counts.clamp_min(1.0))
    return pack_signs(rows, negative).view(n_rows, row_len // 8), scales


def decompress_rows(
    packed: torch.Tensor,
    scales: torch.Tensor,
    row_len: int,
    block_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`compress_rows`: ``scale * sign`` as float32 ``[R, row_len]``.

    ``out``: a contiguous float32 tensor of ``R * row_len`` elements to decode into.

    Padding positions decode to ``±scale`` of their block; callers that keep state across calls
    zero them (they are always at the end of the vector).
    """
    n_rows = scales.shape[0]
    signs = unpack_signs(packed.reshape(n_rows, row_len // 8), n_rows * row_len, out)
    return scale_blocks_(signs.view(n_rows, row_len), scales, block_size)


def compress(x: torch.Tensor, block_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress ``x`` (flattened) to ``(packed signs, block scales)``.

    Returns:
        uint8 ``[ceil(n / 8)]`` and float32 ``[ceil(n / block_size)]`` for ``n = x.numel()``.
    """
    check_block_size(block_size)
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    padded_len = 8 * _ceil_div(n, 8)
    rows = F.pad(flat, (0, padded_len - n)).view(1, padded_len)
    counts = block_counts(torch.tensor([n]), padded_len, block_size)
    packed, scales = compress_rows(rows, block_size, counts)
    return packed.reshape(-1), scales.reshape(-1)


def decompress(
    packed: torch.Tensor, scales: torch.Tensor, n: int, block_size: int = 1024
) -> torch.Tensor:
    """Inverse of :func:`compress`: the float32 vector ``scale * sign`` of length ``n``.

    Raises:
        ValueError: the sizes of ``packed`` or ``scales`` do not match ``n`` and ``block_size``.
    """
    check_block_size(block_size)
    if packed.numel() != _ceil_div(n, 8) or scales.numel() != _ceil_div(n, block_size):
        raise ValueError(
            f"{packed.numel()} sign bytes and {scales.numel()} scales do not describe "
            f"{n} elements in blocks of {block_size}"
        )
    padded_len = 8 * _ceil_div(n, 8)
    rows = decompress_rows(
        packed.reshape(1, -1), scales.reshape(1, -1).to(torch.float32), padded_len, block_size
    )
    return rows.reshape(-1)[:n]
