"""Triton row-wise kernels against their torch references: RMSNorm (+ residual, + per-token int8/fp8
quantization), SiLU-and-mul (+ quantization), per-token quantization, RoPE in place. Fresh random
inputs, several tiny shapes (a single token, non-power-of-2 widths, 3-D inputs), poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from pipeserve.engine.backend import reference as ref
from pipeserve.engine.model.rope import rope_cache
from pipeserve.engine.quantization.formats import QMAX
from pipeserve.engine.triton_kernels import activation, norm, quantize, rope
from tests.kernel_utils import (
    DEVICE,
    INT8_POISON,
    REL_TOL,
    assert_close,
    poisoned_alloc,  # noqa: F401  (fixture, used via usefixtures)
    seeded,
)

pytestmark = [pytest.mark.device, pytest.mark.timeout(120), pytest.mark.usefixtures("poisoned_alloc")]

F32, F16, BF16, I8, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn
DTYPES = [F32, F16, BF16]
SHAPES = [(1, 64), (5, 100), (2, 3, 48)]


def check_quantized(
    q: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, qdtype: torch.dtype
):
    """codes * scale reproduces y (the unquantized reference output) within the format's rounding
    plus the activation dtype's own rounding."""
    assert q.dtype == qdtype and q.shape == y.shape and scale.shape == (*y.shape[:-1], 1)
    assert torch.isfinite(scale).all() and (scale >= 0).all()
    if qdtype == I8:
        assert (q != INT8_POISON).all()
    assert torch.isfinite(q.float()).all()
    yf = y.double()
    amax = yf.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(scale.double(), amax / QMAX[qdtype], rtol=2 * REL_TOL[dtype], atol=0)
    deq = q.double() * scale.double()
    step = scale.double() * 0.5 if qdtype == I8 else yf.abs() / 16 + scale.double() * 2**-9
    assert ((deq - yf).abs() <= step * 1.01 + 2 * REL_TOL[dtype] * amax + 1e-12).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(dtype, shape):
    gen = seeded(shape[-1])
    x = torch.randn(shape, generator=gen).to(dtype)
    res = torch.randn(shape, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    x0, res0 = x.clone(), res.clone()
    assert_close(norm.rms_norm(x, w, 1e-6), ref.rms_norm(x.float(), w.float(), 1e-6), dtype)
    out, new_res = norm.rms_norm(x, w, 1e-6, res)
    want, want_res = ref.rms_norm(x, w, 1e-6, res)
    assert_close(out, want.float(), dtype)
    assert_close(new_res, want_res.float(), dtype)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched


def test_rms_norm_promotes_like_the_reference():
    x = torch.randn(3, 32, generator=seeded(2)).to(BF16)
    w = torch.rand(32, generator=seeded(3))  # fp32 weight, bf16 activations -> fp32 output
    out = norm.rms_norm(x, w, 1e-5)
    assert out.dtype == F32
    assert_close(out, ref.rms_norm(x, w, 1e-5), BF16)


@pytest.mark.parametrize("qdtype", [I8, FP8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_rms_norm_quant(dtype, qdtype, shape):
    gen = seeded(7 * shape[-1])
    x = torch.randn(shape, generator=gen).to(dtype)
    x[0] = 0  # an all-zero row: scale 0, codes 0, no NaN
    res = torch.randn(shape, generator=gen).to(dtype)
    res[0] = 0
    w = torch.randn(shape[-1], generator=gen).to(dtype)
    q, scale = norm.rms_norm_quant(x, w, 1e-6, quant_dtype=qdtype)
    check_quantized(q, scale, ref.rms_norm(x, w, 1e-6), dtype, qdtype)
    assert (scale[0] == 0).all() and (q[0].float() == 0).all()
    q, scale, new_res = norm.rms_norm_quant(x, w, 1e-6, res, qdtype)
    want, want_res = ref.rms_norm(x, w, 1e-6, res)
    check_quantized(q, scale, want, dtype, qdtype)
    assert_close(new_res, want_res.float(), dtype)
    if dtype != BF16:  # exact codes (bf16 rounding differs in the interpreter)
        want_q, want_scale, _ = ref.rms_norm_quant(x, w, 1e-6, res, qdtype)
        assert torch.equal(q.float(), want_q.float())
        torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 40), (6, 2 * 1100), (2, 2, 2 * 24)])
def test_silu_and_mul(dtype, shape):
    x = torch.randn(shape, generator=seeded(shape[-1])).to(dtype)
    out = activation.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    assert_close(out, ref.silu_and_mul(x.double()), dtype)


@pytest.mark.parametrize("qdtype", [I8, FP8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 40), (4, 2 * 2100)])  # the second row spans two blocks
def test_silu_and_mul_quant(dtype, qdtype, shape):
    x = torch.randn(shape, generator=seeded(3 * shape[-1])).to(dtype)
    q, scale = activation.silu_and_mul_quant(x, qdtype)
    check_quantized(q, scale, ref.silu_and_mul(x), dtype, qdtype)
    # exp differs in the last bit between Triton and torch: codes may differ by a rounding step
    want_q, want_scale = ref.silu_and_mul_quant(x, qdtype)
    torch.testing.assert_close(scale, want_scale, rtol=2 * REL_TOL[dtype], atol=0)
    if qdtype == I8:
        assert (q.int() - want_q.int()).abs().max() <= 1


@pytest.mark.parametrize("qdtype", [I8, FP8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_token_quant(dtype, qdtype):
    x = torch.randn(5, 5000, generator=seeded(11)).to(dtype) * torch.logspace(-2, 2, 5)[:, None].to(dtype)
    x[2] = 0
    q, scale = quantize.per_token_quant(x, qdtype)
    check_quantized(q, scale, x, dtype, qdtype)
    want_q, want_scale = ref.per_token_quant(x, qdtype)
    assert torch.equal(q.float(), want_q.float())  # no rounding of x itself: bit-exact in every dtype
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,head_dim,rot_dim,tokens", [((4, 2), 64, 64, 5), ((8, 1), 8, 8, 1), ((3, 3), 24, 16, 7)]
)
def test_rope_in_place(dtype, heads, head_dim, rot_dim, tokens):
    gen = seeded(head_dim + tokens)
    hq, hkv = heads
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    cos_sin = rope_cache(rot_dim, 128, 10000.0, scaling, device=DEVICE)
    # q and k as strided views of one fused qkv row, as the model produces them.
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    v_before = qkv[:, (hq + hkv) * head_dim :].clone()
    want_q, want_k = q.double(), k.double()
    ref.apply_rope(want_q, want_k, positions, cos_sin.double())
    rope.apply_rope(q, k, positions, cos_sin)
    assert_close(q, want_q, dtype)
    assert_close(k, want_k, dtype)
    assert torch.equal(qkv[:, (hq + hkv) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("qdtype", [I8, FP8])
def test_code_rounding_matches_torch_on_ties(qdtype):
    """With scale exactly 1 (row max = qmax) the codes are the rounded inputs: every midpoint between
    two representable values (ties), and values just off them, must round as the reference does."""
    if qdtype == FP8:
        grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # all finite e4m3 >= 0
    else:
        grid = torch.arange(0, 128).float()
    mid = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat(
        [grid, mid, mid + mid * 2**-12, mid - mid * 2**-12, torch.rand(200, generator=seeded(4)) * 100]
    )
    vals = torch.cat([vals, -vals])
    row = torch.cat([torch.tensor([QMAX[qdtype]]), vals])[None].clamp(-QMAX[qdtype], QMAX[qdtype])
    q, scale = quantize.per_token_quant(row, qdtype)
    want_q, want_scale = ref.per_token_quant(row, qdtype)
    assert scale.item() == want_scale.item() == 1.0
    assert torch.equal(q.float(), want_q.float())
