"""int8 / fp8 codes in Triton: the jit helpers every quantizing kernel turns fp32 into codes with
(rounding as pipeserve/engine/quantization/formats.py), and dynamic per-token activation quantization
(one fp32 scale per row, no calibration)."""
# Triton reads a jit function's parameter annotations as its signature: its parameters stay untyped.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"


from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from pipeserve.engine.quantization.formats import QMAX

from .common import check_fp8, pow2

QuantOut = tuple[torch.Tensor, torch.Tensor]


@triton.jit
def fp8e4m3_round(y):
    """Round fp32 to the nearest e4m3 value (ties to even) in fp32, so the cast that follows is exact:
    the interpreter's fp8 cast drops the carry into the next binade and truncates subnormals."""
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # keep 3 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    # Subnormals (|y| < 2**-6) are multiples of 2**-9: round |y| * 512 to an integer, ties to even.
    a = tl.abs(y) * 512.0
    whole = a.to(tl.int32)
    frac = a - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    sub = (whole + up.to(tl.int32)).to(tl.float32) * (1.0 / 512.0)
    sub = tl.where(y < 0, -sub, sub)
    return tl.where(tl.abs(y) >= 0.015625, normal, sub)


@triton.jit
def to_codes(y, IS_INT8: tl.constexpr):
    """fp32 values already divided by their scale -> int8 (round half away, saturate) or fp8 codes."""
    if IS_INT8:  # float -> int casts truncate and wrap: round, clamp, then cast
        y = tl.where(y >= 0, y + 0.5, y - 0.5)
        codes = tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8)
    else:  # fp8 casts do not saturate everywhere
        codes = fp8e4m3_round(tl.minimum(tl.maximum(y, -448.0), 448.0)).to(tl.float8e4nv)
    return codes  # one return: the compiler checks every return's type, taken branch or not


@triton.jit
def inverse(s):
    """1 / s, 0 where s == 0 (an all-zero group quantizes to zeros). Correctly rounded, as torch's: a
    GPU's plain fp32 `/` is approximate, and a code on a rounding boundary would land a step apart."""
    return tl.where(s > 0, tl.math.div_rn(1.0, tl.where(s > 0, s, 1.0)), 0.0)


def quant_outputs(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> QuantOut:
    """Codes of `shape` in `dtype` and one fp32 scale per row, for a per-token quantizing kernel."""
    check_fp8(dtype, device)
    scale = torch.empty(*shape[:-1], 1, dtype=torch.float32, device=device)
    return torch.empty(shape, dtype=dtype, device=device), scale


def quant_kwargs(dtype: torch.dtype | None) -> dict[str, Any]:
    """The QMAX / IS_INT8 constexprs of a kernel quantizing to `dtype` (None: not quantizing)."""
    return {"QMAX": 1.0 if dtype is None else QMAX[dtype], "IS_INT8": dtype == torch.int8}


@triton.jit
def _per_token_quant_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, N, QMAX: tl.constexpr, IS_INT8: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    amax = tl.zeros([BLOCK], tl.float32)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < N, other=0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.max(amax, axis=0) * (1.0 / QMAX)  # times the reciprocal, as the reference
    inv = inverse(scale)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < N, other=0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + offs, to_codes(x * inv, IS_INT8), mask=offs < N)
    tl.store(s_ptr + row, scale)


def per_token_quant(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> QuantOut:
    """x [T, N] -> (codes [T, N] int8 / fp8, scale fp32 [T, 1]) with scale = max|row| / qmax."""
    t, n = x.shape
    assert x.stride(-1) == 1
    q, scale = quant_outputs(x.shape, dtype, x.device)
    if t:
        _per_token_quant_kernel[(t,)](
            x, q, scale, x.stride(0), q.stride(0), n, BLOCK=min(pow2(n), 4096), num_warps=4,
            **quant_kwargs(dtype),
        )  # fmt: skip
    return q, scale
