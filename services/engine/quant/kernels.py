"""The quantized ops a quantized model calls, per backend. The Triton kernels and their torch
references live in services/engine/kernels/; the torch path here runs the GEMMs on real int8 / fp8
math (torch._int_mm, torch._scaled_mm: both run on this CPU) rather than on dequantized fp32."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from services.engine.kernels import activation, gemm_fp8, gemm_int4, gemm_int8, norm, quant


@dataclass(frozen=True)
class QuantKernels:
    name: str
    per_token_quant: Callable  # (x [T, K], dtype) -> (codes, fp32 scale [T, 1])
    rms_norm_quant: Callable  # (x, weight, eps, residual, quant_dtype) -> (codes, scale[, x + residual])
    silu_and_mul_quant: Callable  # (x [T, 2I], quant_dtype) -> (codes [T, I], scale)
    int8_gemm: Callable  # (a, a_scale [T, 1], w [N, K], w_scale [N], bias, out_dtype) -> [T, N]
    fp8_gemm: Callable  # same, fp8 e4m3 codes
    w4a16_gemm: Callable  # (a [T, K], qweight, scales, zeros | None) -> [T, N] in a's dtype


def _int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] x int8 [K, N] -> int32. CUDA's kernel wants M > 16: pad decode-sized batches."""
    m = a.shape[0]
    if a.is_cuda and m <= 16:
        return torch._int_mm(F.pad(a, (0, 0, 0, 17 - m)), b)[:m]
    return torch._int_mm(a, b)


def int8_gemm_torch(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16
                    ) -> torch.Tensor:  # fmt: skip
    c = _int_mm(a, w.t()).float() * a_scale * w_scale
    return (c if bias is None else c + bias.float()).to(out_dtype)


def fp8_gemm_torch(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    # Row-wise scaled fp8 on CUDA only writes bf16; the CPU kernel writes fp32 as well.
    acc_dtype = torch.float32 if a.device.type == "cpu" else torch.bfloat16
    c = torch._scaled_mm(a, w.t(), scale_a=a_scale.float(), scale_b=w_scale.float().view(1, -1),
                         out_dtype=acc_dtype)
    return (c if bias is None else c + bias.to(acc_dtype)).to(out_dtype)


@cache
def quant_kernels(backend: str) -> QuantKernels:
    if backend == "torch":
        return QuantKernels("torch", quant.per_token_quant_ref, norm.rms_norm_quant_ref,
                            activation.silu_and_mul_quant_ref, int8_gemm_torch, fp8_gemm_torch,
                            gemm_int4.w4a16_gemm_ref)
    if backend == "triton":
        return QuantKernels("triton", quant.per_token_quant, norm.rms_norm_quant,
                            activation.silu_and_mul_quant, gemm_int8.int8_gemm, gemm_fp8.fp8_gemm,
                            gemm_int4.w4a16_gemm)
    raise ValueError(f"unknown backend {backend!r} (torch or triton)")
