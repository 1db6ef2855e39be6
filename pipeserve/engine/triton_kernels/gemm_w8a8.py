"""W8A8 GEMM: int8 (or fp8 e4m3) activations with one scale per token times int8 (or fp8) weights with
one scale per output channel; int32 (fp32) accumulation, scales and optional bias applied in the
epilogue. C [M, N] = (A [M, K] @ W[N, K]^T) * a_scale[M] * w_scale[N] + bias[N].
Decode-sized M splits K across programs (fp32 atomics) to fill the GPU. One kernel, tuned separately
for int8 and for fp8 (Hopper-class GPUs)."""
# Triton reads a jit function's parameter annotations as its signature: its parameters stay untyped.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"


from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .common import (
    check_fp8,
    gemm_autotune,
    gemm_grid,
    gemm_output,
    gemm_store,
    gemm_tile,
    m_bucket,
    split_k_for,
)

_SMALL_M = [(16, 64, 256, 4, 4), (16, 128, 128, 4, 4), (32, 64, 256, 4, 4), (32, 128, 128, 4, 4),
            (64, 64, 256, 4, 4)]
INT8_SHAPES = [(128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 64, 4, 4),
               (64, 128, 128, 4, 4), (64, 256, 128, 8, 3), *_SMALL_M, (64, 128, 128, 4, 3)]
FP8_SHAPES = [(128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 128, 4, 4),
              (64, 256, 128, 8, 3), (64, 128, 128, 4, 4), *_SMALL_M]


@triton.jit
def w8a8_kernel(a_ptr, w_ptr, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, M_BUCKET,
                stride_am, stride_wn, stride_cm, HAS_BIAS: tl.constexpr, ACC_INT: tl.constexpr,
                SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr):
    rm, rn, pid_k = gemm_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rk = tl.arange(0, BLOCK_K)
    # Out-of-range rows/columns wrap onto valid ones (no load masks); their results are not stored.
    a_ptrs = a_ptr + (rm % M).to(tl.int64)[:, None] * stride_am + (pid_k * BLOCK_K + rk)[None, :]
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[None, :] * stride_wn + (pid_k * BLOCK_K + rk)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32 if ACC_INT else tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        a = tl.load(a_ptrs, mask=(k0 + rk)[None, :] < K, other=0.0)
        w = tl.load(w_ptrs, mask=(k0 + rk)[:, None] < K, other=0.0)
        acc = tl.dot(a, w, acc, out_dtype=acc.dtype)  # int32 for int8: Triton 3.6 defaults to fp32
        a_ptrs += BLOCK_K * SPLIT_K
        w_ptrs += BLOCK_K * SPLIT_K
    a_scale = tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)
    c = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        c += bias[None, :] * (pid_k == 0)
    gemm_store(c_ptr, c, rm, rn, M, N, stride_cm, SPLIT_K)


_KERNELS: dict[torch.dtype, Any] = {
    torch.int8: gemm_autotune(INT8_SHAPES, key=[])(w8a8_kernel),
    torch.float8_e4m3fn: gemm_autotune(FP8_SHAPES, key=[])(w8a8_kernel),
}


def w8a8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    split_k: int | None = None,
) -> torch.Tensor:
    """a [M, K] x w [N, K], both int8 or both fp8, with fp32 a_scale [M, 1] and w_scale [N] ->
    out_dtype [M, N]."""
    m, k = a.shape
    n = w.shape[0]
    assert a.dtype == w.dtype and a.dtype in _KERNELS, (a.dtype, w.dtype)
    assert w.shape[1] == k and a.stride(1) == 1 and w.stride(1) == 1
    assert a_scale.numel() == m and w_scale.numel() == n
    check_fp8(a.dtype, a.device)
    split_k = split_k_for(m, n, k, a.device) if split_k is None else split_k
    c = gemm_output(m, n, out_dtype, split_k, a.device)
    if m:
        _KERNELS[a.dtype][gemm_grid](
            a, w, c, a_scale.float().contiguous(), w_scale.float().contiguous(), bias, m, n, k, m_bucket(m),
            a.stride(0), w.stride(0), c.stride(0),
            HAS_BIAS=bias is not None, ACC_INT=a.dtype == torch.int8, SPLIT_K=split_k,
        )  # fmt: skip
    return c.to(out_dtype) if split_k > 1 else c


def int8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
              split_k: int | None = None) -> torch.Tensor:
    assert a.dtype == torch.int8
    return w8a8_gemm(a, a_scale, w, w_scale, bias, out_dtype, split_k)


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             split_k: int | None = None) -> torch.Tensor:
    assert a.dtype == torch.float8_e4m3fn
    return w8a8_gemm(a, a_scale, w, w_scale, bias, out_dtype, split_k)


