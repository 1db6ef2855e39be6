"""RMSNorm kernels: plain, fused with the residual add, and fused with dynamic per-token int8 / fp8
quantization of the output (PPL.LLM: the next GEMM's input is quantized where it is produced, one
pass, no calibration). One program per row, rounding like HF (sum and normalized value rounded to
the activation dtype), as the reference backend does."""
# Triton reads a jit function's parameter annotations as its signature: its parameters stay untyped.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"


from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pow2, tl_dtype
from .quantize import QuantOut, inverse, quant_kwargs, quant_outputs, to_codes


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    q_ptr,
    scale_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    stride_q,
    N,
    eps,
    OUT_DTYPE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT8: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.float32)
    y = (w * normed).to(OUT_DTYPE)
    if QUANT:
        yf = y.to(tl.float32)
        scale = tl.max(tl.abs(yf), axis=0) * (1.0 / QMAX)
        tl.store(q_ptr + row * stride_q + offs, to_codes(yf * inverse(scale), IS_INT8), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_out + offs, y, mask=mask)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    quant_dtype: torch.dtype | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(shape, dtype=out_dtype, device=x.device) if quant_dtype is None else None
    res2 = res_out = None
    if residual is not None:
        res2 = residual.reshape(-1, n)
        res_out = torch.empty_like(x)
    q, scale = (None, None) if quant_dtype is None else quant_outputs(shape, quant_dtype, x.device)
    if rows:
        block = pow2(n)
        _rms_norm_kernel[(rows,)](
            x2,
            res2,
            weight,
            out,
            res_out,
            q,
            scale,
            x2.stride(0),
            0 if res2 is None else res2.stride(0),
            n,
            n,
            n,
            n,
            eps,
            OUT_DTYPE=tl_dtype(out_dtype),
            HAS_RESIDUAL=residual is not None,
            QUANT=quant_dtype is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
            **quant_kwargs(quant_dtype),
        )
    return out, res_out, q, scale


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The rms_norm op: norm(x), or (norm(x + residual), x + residual)."""
    out, res_out, _, _ = _launch(x, weight, eps, residual, None)
    assert out is not None
    if res_out is None:
        return out
    return out, res_out


def rms_norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quant_dtype: torch.dtype = torch.int8,
) -> QuantOut | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm whose output is quantized per token: (codes, fp32 scale [..., 1]), plus x + residual
    when a residual is given."""
    _, res_out, q, scale = _launch(x, weight, eps, residual, quant_dtype)
    assert q is not None and scale is not None
    if res_out is None:
        return q, scale
    return q, scale, res_out
