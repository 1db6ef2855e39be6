"""SiLU-and-mul of the fused gate/up projection, plain and fused with dynamic per-token int8 / fp8
quantization of its output (the down projection's W8A8 input). Rounds like the reference backend:
silu(gate) to the activation dtype, then the product."""
# Triton reads a jit function's parameter annotations as its signature: its parameters stay untyped.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"


from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pow2
from .quantize import QuantOut, inverse, quant_kwargs, quant_outputs, to_codes


@triton.jit
def silu_mul(x_ptr, row_ptr, offs, mask, N):
    """silu(gate) * up for the columns offs of one [gate | up] row, in fp32, rounded like torch."""
    dtype = x_ptr.dtype.element_ty
    g = tl.load(row_ptr + offs, mask=mask, other=0).to(tl.float32)
    u = tl.load(row_ptr + N + offs, mask=mask, other=0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (s * u).to(dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    y = silu_mul(x_ptr, x_ptr + row * stride_x, offs, mask, N)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stride_x,
    stride_q,
    N,
    QMAX: tl.constexpr,
    IS_INT8: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Two passes over the row (the second mostly from L2): the scale needs the whole row's max.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], tl.float32)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(silu_mul(x_ptr, row_ptr, offs, offs < N, N)))
    scale = tl.max(amax, axis=0) * (1.0 / QMAX)
    inv = inverse(scale)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        y = silu_mul(x_ptr, row_ptr, offs, offs < N, N)
        tl.store(q_ptr + row * stride_q + offs, to_codes(y * inv, IS_INT8), mask=offs < N)
    tl.store(scale_ptr + row, scale)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The silu_and_mul op: [T, 2I] -> [T, I]."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(pow2(n), 1024)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, x2.stride(0), n, n, BLOCK=block, num_warps=4
        )
    return out


def silu_and_mul_quant(x: torch.Tensor, quant_dtype: torch.dtype = torch.int8) -> QuantOut:
    """silu_and_mul quantized per token: (codes [..., I], fp32 scale [..., 1])."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    q, scale = quant_outputs((*x.shape[:-1], n), quant_dtype, x.device)
    if x2.shape[0]:
        _silu_and_mul_quant_kernel[(x2.shape[0],)](
            x2, q, scale, x2.stride(0), n, n, BLOCK=min(pow2(n), 2048), num_warps=8,
            **quant_kwargs(quant_dtype),
        )  # fmt: skip
    return q, scale
