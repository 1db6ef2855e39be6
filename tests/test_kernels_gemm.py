"""Triton GEMMs against torch references in fp64: W8A8 int8 and fp8 (per-token x per-channel scales,
bias, split-K), W4A16 int4 with zero points and NF4, plus the quantizers' error bounds and the
4-bit packing. Tiny shapes with ragged M/N/K; outputs poisoned before each run."""

from __future__ import annotations

import pytest
import torch
import triton

from pipeserve.engine.backend import reference as ref
from pipeserve.engine.quantization import formats as quant_formats
from pipeserve.engine.quantization.weights import quantize_int4, quantize_nf4, quantize_per_channel
from pipeserve.engine.triton_kernels import common, gemm_w4a16, gemm_w8a8
from pipeserve.engine.triton_kernels.common import Fixed, interpreting
from tests.kernel_utils import (
    assert_close,
    poisoned_alloc,  # noqa: F401  (fixture, used via usefixtures)
    seeded,
)

pytestmark = [pytest.mark.device, pytest.mark.timeout(120), pytest.mark.usefixtures("poisoned_alloc")]

F32, F16, BF16, I8, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn


def exact_w8a8(a, a_scale, w, w_scale, bias):
    c = (a.double() @ w.double().T) * a_scale.double().reshape(-1, 1) * w_scale.double().reshape(1, -1)
    return c if bias is None else c + bias.double()


@pytest.mark.parametrize("qdtype", [I8, FP8])
@pytest.mark.parametrize(
    "m,n,k,out_dtype,with_bias,split_k",
    [
        (1, 48, 64, BF16, False, 1),
        (1, 40, 80, F32, True, 2),
        (37, 96, 160, F16, True, 1),
        (19, 64, 96, BF16, True, 3),
        (64, 32, 32, F32, False, None),
    ],
)
def test_w8a8_gemm(qdtype, m, n, k, out_dtype, with_bias, split_k):
    gen = seeded(m * n + k)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, m)[:, None]
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen).to(out_dtype) if with_bias else None
    a, a_scale = ref.per_token_quant(x, qdtype)
    qw, w_scale = quantize_per_channel(w, qdtype)
    gemm = gemm_w8a8.int8_gemm if qdtype == I8 else gemm_w8a8.fp8_gemm
    out = gemm(a, a_scale, qw, w_scale, bias, out_dtype, split_k=split_k)
    assert out.dtype == out_dtype
    assert_close(out, exact_w8a8(a, a_scale, qw, w_scale, bias), out_dtype)
    # The reference used by the torch backend agrees too, and the quantized GEMM approximates x @ w.T.
    assert_close(
        ref.scaled_gemm(a, a_scale, qw, w_scale, bias, F32), exact_w8a8(a, a_scale, qw, w_scale, bias)
    )
    dense = x @ w.T + (0 if bias is None else bias.float())
    rel = (out.double() - dense).abs().max() / dense.abs().max()
    assert rel < (0.03 if qdtype == I8 else 0.1)


@pytest.mark.skipif(not interpreting(), reason="pins the interpreter's fixed config")
def test_w8a8_other_tiles(monkeypatch):
    """A second tile shape (rows and columns padded differently, several K steps per split)."""
    monkeypatch.setattr(
        gemm_w8a8._KERNELS[I8],
        "config",
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 1}),
    )
    assert isinstance(gemm_w8a8._KERNELS[I8], Fixed)
    gen = seeded(3)
    a = torch.randint(-127, 128, (33, 200), generator=gen, dtype=I8)
    w = torch.randint(-127, 128, (17, 200), generator=gen, dtype=I8)
    sa, sw = torch.rand(33, 1, generator=gen), torch.rand(17, generator=gen)
    for split_k in (1, 2):
        out = gemm_w8a8.int8_gemm(a, sa, w, sw, None, F32, split_k=split_k)
        assert_close(out, exact_w8a8(a, sa, w, sw, None))


def test_pack_int4_roundtrip():
    codes = torch.randint(0, 16, (24, 64), generator=seeded(5))
    packed = quant_formats.pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (8, 24)
    assert torch.equal(quant_formats.unpack_int4(packed), codes)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("group", [32, 128])
def test_4bit_quantizers_error_bounds(dtype, group):
    w = (torch.randn(16, 256, generator=seeded(group)) * 0.02).to(dtype)
    w[0, :group] = 0  # a constant group: no NaN, exact zeros
    qw, scales, zeros = quantize_int4(w, group)
    assert scales.shape == zeros.shape == (256 // group, 16) and scales.dtype == dtype
    deq = quant_formats.dequantize_4bit(qw, scales, zeros)
    step = scales.float().T.repeat_interleave(group, 1)
    assert torch.isfinite(deq).all() and (deq[0, :group] == 0).all()
    assert ((deq - w.float()).abs() <= 0.5 * step * 1.01 + 1e-7).all()
    qn, absmax = quantize_nf4(w, group)
    deq = quant_formats.dequantize_4bit(qn, absmax)
    levels = quant_formats.NF4_LEVELS
    biggest_gap = max(b - a for a, b in zip(levels, levels[1:], strict=False))
    bound = absmax.float().T.repeat_interleave(group, 1) * biggest_gap / 2
    assert torch.isfinite(deq).all() and ((deq - w.float()).abs() <= bound * 1.01 + 1e-7).all()


@pytest.mark.parametrize("nf4", [False, True])
@pytest.mark.parametrize(
    "m,n,k,group,dtype,split_k",
    [
        (1, 48, 64, 32, F32, 1),
        (1, 40, 256, 128, BF16, 2),
        (19, 96, 256, 128, F16, 1),
        (37, 24, 128, 32, BF16, None),
    ],
)
def test_w4a16_gemm(nf4, m, n, k, group, dtype, split_k):
    gen = seeded(m + n + k)
    a = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    if nf4:
        qw, scales = quantize_nf4(w, group)
        zeros = None
    else:
        qw, scales, zeros = quantize_int4(w, group)
    out = gemm_w4a16.w4a16_gemm(a, qw, scales, zeros, split_k=split_k)
    assert out.dtype == dtype and out.shape == (m, n)
    exact = a.double() @ quant_formats.dequantize_4bit(qw, scales, zeros).double().T
    assert_close(out, exact, dtype)
    assert_close(ref.w4a16_gemm(a, qw, scales, zeros), exact, dtype)


def test_fp8_launches_refuse_gpus_below_sm89(monkeypatch):
    """Triton has no e4m3 before Ada: an fp8 launch on an Ampere GPU says so instead of failing to
    compile (the compile matrix leaves those variants out for sm_80)."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(common, "capability", lambda index: (8, 0))
    with pytest.raises(ValueError, match=r"sm_89 or newer .* sm_80: use int8"):
        common.check_fp8(FP8, cuda)
    common.check_fp8(I8, cuda)  # int8 runs everywhere
    common.check_fp8(FP8, torch.device("cpu"))  # the interpreter
    monkeypatch.setattr(common, "capability", lambda index: (9, 0))
    common.check_fp8(FP8, cuda)


def test_int4_scale_never_rounds_below_the_group_range():
    # A bf16 scale rounded down made (max - min) / scale exceed 15 codes: the group's extreme clipped,
    # more than half a step off (about two seeds in three of these failed before).
    for seed in range(24):
        w = (torch.randn(16, 256, generator=torch.Generator().manual_seed(seed), device="cpu") * 0.02)
        w = w.to(torch.bfloat16)
        qw, scales, zeros = quantize_int4(w, 32)
        deq = quant_formats.dequantize_4bit(qw, scales, zeros)
        step = scales.float().T.repeat_interleave(32, 1)
        assert ((deq - w.float()).abs() <= 0.5 * step * 1.01 + 1e-7).all(), seed


def test_w4a16_tiles_lie_in_one_quantization_group():
    # Autotuning on a GPU may only try K tiles that a group divides (the kernel reads one scale per
    # tile); every group size has some, and the group is part of the tuning key.
    for group in (32, 64, 128):
        kept = gemm_w4a16.tiles_in_group(common.gemm_configs(gemm_w4a16.SHAPES), {"M": 1}, QGROUP=group)
        assert kept and all(group % c.kwargs["BLOCK_K"] == 0 for c in kept)
        assert any(c.kwargs["BLOCK_K"] == group or c.kwargs["BLOCK_K"] == 128 for c in kept)
    assert gemm_w4a16.tiles_in_group(common.gemm_configs(gemm_w4a16.SHAPES), {}, QGROUP=32) == [
        c for c in common.gemm_configs(gemm_w4a16.SHAPES) if c.kwargs["BLOCK_K"] == 32]
    with pytest.raises(AssertionError, match="multiples of 32"):
        a = torch.randn(1, 64)
        qw, scales, zeros = quantize_int4(torch.randn(16, 64), 16)
        gemm_w4a16.w4a16_gemm(a, qw, scales, zeros)
