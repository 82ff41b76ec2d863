"""1-bit compression in one process: sign packing and block scales round trip, bad sizes are
refused, and the error buffers, keyed by parameter names, survive a checkpoint and a new bucket
layout."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fuelline.trainer.onebit import OneBitState, compress, decompress, pack_signs, unpack_signs

# -- format -------------------------------------------------------------------------------------
RANDOM_LENGTHS = torch.randint(0, 5000, (5,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1023, 1024, 1025, *RANDOM_LENGTHS])
def test_pack_unpack_round_trip(n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    if n:
        x[:: max(1, n // 5)] = 0.0  # zeros and negative zeros count as positive
        x[1 :: max(1, n // 3)] = -0.0
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (math.ceil(n / 8),)
    signs = unpack_signs(packed, n)
    assert signs.dtype == torch.float32
    assert torch.equal(signs, torch.where(x < 0, -1.0, 1.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_pack_and_compress_like_float32(dtype: torch.dtype) -> None:
    x = torch.randn(1001, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert torch.equal(pack_signs(x), pack_signs(x.float()))
    for got, want in zip(compress(x, 64), compress(x.float(), 64)):
        assert torch.equal(got, want)


def test_pack_bit_order_and_nan() -> None:
    x = torch.tensor([-1.0, 1.0, -1.0, 0.0, float("nan"), -0.0, 2.0, -3.0, -5.0])
    packed = pack_signs(x)
    assert packed.tolist() == [0b1000_0101, 0b1]  # element 8j+i is bit i of byte j
    assert unpack_signs(packed, 9).tolist() == [-1, 1, -1, 1, 1, 1, 1, -1, -1]


def test_unpack_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        unpack_signs(torch.zeros(1, dtype=torch.uint8), 9)
    with pytest.raises(ValueError):
        unpack_signs(torch.zeros(1, dtype=torch.int32), 1)


@pytest.mark.parametrize("n", [0, 1, 9, 1023, 1024, 1025, 3000])
@pytest.mark.parametrize("block_size", [8, 64, 1024])
def test_compress_round_trip_keeps_block_l1(n: int, block_size: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * torch.linspace(0.1, 10, n)
    packed, scales = compress(x, block_size)
    assert packed.shape == (math.ceil(n / 8),) and scales.shape == (math.ceil(n / block_size),)
    y = decompress(packed, scales, n, block_size)
    assert y.shape == (n,)
    assert torch.equal(torch.sign(y), torch.where(x < 0, -1.0, 1.0))
    for b in range(scales.numel()):
        block = slice(b * block_size, (b + 1) * block_size)
        torch.testing.assert_close(y[block].abs().sum(), x[block].abs().sum())


def test_decompress_and_state_reject_bad_sizes() -> None:
    packed, scales = compress(torch.randn(100), 64)
    with pytest.raises(ValueError):
        decompress(packed, scales, 105, 64)  # 14 sign bytes, not 13
    with pytest.raises(ValueError):
        decompress(packed, scales[:1], 100, 64)
    with pytest.raises(ValueError):
        compress(torch.randn(10), 12)
    with pytest.raises(ValueError):
        OneBitState(warmup_iters=1)  # covers no bucket rebuild
    OneBitState(warmup_iters=0, error_feedback=False)


# -- error buffers keyed by parameter names -------------------------------------------------------
def _named_state() -> tuple[OneBitState, nn.Module]:
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))  # 0.weight 6, 0.bias 2, 1.weight 4, 1.bias 2
    state = OneBitState(warmup_iters=2)
    state.name_parameters(model)
    return state, model


def test_a_bucket_has_one_key_and_layout_whatever_order_ddp_gives_its_parameters() -> None:
    from fuelline.trainer.onebit_layout import bucket_layout

    state, model = _named_state()
    params = list(model.parameters())
    forward = bucket_layout(params, state.places)
    backward = bucket_layout(params[::-1], state.places)
    assert forward is not None and backward is not None
    assert forward[0] == backward[0] == ("0.weight", "0.bias", "1.weight", "1.bias")
    flat = torch.cat([p.detach().reshape(-1) for p in params[::-1]])  # the bucket as DDP laid it out
    canonical = torch.cat([p.detach().reshape(-1) for p in params])
    assert torch.equal(flat[backward[2]], canonical)
    assert bucket_layout([nn.Parameter(torch.zeros(2))], state.places) is None  # unnamed: keyed by index


def test_error_buffers_saved_per_parameter_land_where_a_rebuilt_bucket_puts_them() -> None:
    from fuelline.trainer.checkpoint import plain

    state, _ = _named_state()
    key = ("0.weight", "0.bias", "1.weight", "1.bias")
    state.layouts[key] = (("0.weight", 6), ("0.bias", 2), ("1.weight", 4), ("1.bias", 2))
    state.send_errors[key] = torch.arange(14, dtype=torch.float32)
    state.reduce_errors[key] = torch.arange(100, 108, dtype=torch.float32)  # rank 0 owns positions 0..7
    state.iter = 7
    saved = plain(state.state_dict())
    assert plain(saved) is saved  # plain data only: a weights_only checkpoint holds it

    # The same world size, the parameters now in two buckets: each gets its own part back.
    fresh, _ = _named_state()
    fresh.load_state_dict(saved)
    assert fresh.iter == 7 and fresh.bytes_sent == 0
    first, second = ("0.weight", "0.bias"), ("1.weight", "1.bias")
    fresh.layouts[first] = (("0.weight", 6), ("0.bias", 2))
    fresh.layouts[second] = (("1.weight", 4), ("1.bias", 2))
    assert fresh.error_buffer(fresh.send_errors, second, torch.zeros(6)).tolist() == list(range(8, 14))
    assert fresh.error_buffer(fresh.send_errors, first, torch.zeros(8)).tolist() == list(range(8))
    # Rank 0's server chunk of the second bucket (4 elements from position 0): 1.weight's part was
    # never this rank's to own, so it starts from zero.
    assert fresh.error_buffer(fresh.reduce_errors, second, torch.zeros(4)).tolist() == [0.0] * 4
    assert fresh.error_buffer(fresh.reduce_errors, first, torch.zeros(4)).tolist() == [100.0, 101.0, 102.0, 103.0]

    # Another world size: the warm-up stays done, the per-rank buffers do not apply.
    other, _ = _named_state()
    other.load_state_dict(saved, buffers=False)
    assert other.iter == 7
    other.layouts[key] = state.layouts[key]
    assert not other.error_buffer(other.send_errors, key, torch.zeros(14)).any()


# -- the CPU path and the tensor path (what runs on an accelerator) agree --------------------------
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1023, 1025, *RANDOM_LENGTHS])
def test_numpy_and_tensor_sign_paths_agree_bit_for_bit(n: int) -> None:
    from fuelline.trainer import bitpack

    x = torch.randn(n, generator=torch.Generator().manual_seed(n + 11))
    if n:
        x[:: max(1, n // 4)] = -0.0
        x[1 :: max(1, n // 3)] = float("nan")
    packed = pack_signs(x)
    assert torch.equal(packed, bitpack._pack_signs_tensor(x < 0))
    assert torch.equal(unpack_signs(packed, n), bitpack._unpack_signs_tensor(packed, n))
    out = torch.full((8 * packed.numel(),), 5.0)
    assert torch.equal(unpack_signs(packed, n, out), bitpack._unpack_signs_tensor(packed, n))
    assert unpack_signs(packed, n, out).data_ptr() == out.data_ptr()  # written where asked


def test_unpack_into_a_buffer_that_does_not_fit_is_refused() -> None:
    packed = pack_signs(torch.randn(16))
    with pytest.raises(ValueError, match="out must be 16"):
        unpack_signs(packed, 16, torch.empty(15))
