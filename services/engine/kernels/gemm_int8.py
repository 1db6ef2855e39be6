"""W8A8 GEMM: int8 (or fp8) activations with one scale per token times int8 (or fp8) weights with
one scale per output channel; int32 (fp32) accumulation, scales and optional bias applied in the
epilogue. C [M, N] = (A [M, K] @ W[N, K]^T) * a_scale[M] * w_scale[N] + bias[N].
Decode-sized M splits K across programs (fp32 atomics) to fill the GPU. gemm_fp8.py reuses the kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import autotune, gemm_grid, m_bucket, prune_by_m, split_k_for, tile_ids


def _configs() -> list[triton.Config]:
    big = [
        (128, 256, 128, 8, 3),
        (256, 128, 128, 8, 3),
        (128, 128, 128, 8, 4),
        (128, 128, 64, 4, 4),
        (64, 128, 128, 4, 4),
        (64, 256, 128, 8, 3),
    ]
    small = [
        (16, 64, 256, 4, 4),
        (16, 128, 128, 4, 4),
        (32, 64, 256, 4, 4),
        (32, 128, 128, 4, 4),
        (64, 64, 256, 4, 4),
        (64, 128, 128, 4, 3),
    ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in big + small
    ]


INTERPRET_CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2})


@triton.jit
def w8a8_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    a_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    M,
    N,
    K,
    M_BUCKET,
    stride_am,
    stride_wn,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    ACC_INT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Out-of-range rows/columns wrap onto valid ones (no load masks); their results are not stored.
    a_ptrs = a_ptr + (rm % M).to(tl.int64)[:, None] * stride_am + (pid_k * BLOCK_K + rk)[None, :]
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[None, :] * stride_wn + (pid_k * BLOCK_K + rk)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32 if ACC_INT else tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        a = tl.load(a_ptrs, mask=(k0 + rk)[None, :] < K, other=0.0)
        w = tl.load(w_ptrs, mask=(k0 + rk)[:, None] < K, other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K * SPLIT_K
        w_ptrs += BLOCK_K * SPLIT_K
    a_scale = tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)
    c = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        c += bias[None, :] * (pid_k == 0)
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, c.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(c_ptrs, c, mask=mask)


_int8_kernel = autotune(
    _configs(),
    key=["M_BUCKET", "N", "K", "SPLIT_K"],
    interpret_config=INTERPRET_CONFIG,
    prune_configs_by={"early_config_prune": prune_by_m},
    reset_to_zero=["c_ptr"],
)(w8a8_kernel)


def launch_w8a8(
    kernel,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    split_k: int | None,
) -> torch.Tensor:
    m, k = a.shape
    n = w.shape[0]
    assert w.shape[1] == k and a.stride(1) == 1 and w.stride(1) == 1
    assert a_scale.numel() == m and w_scale.numel() == n
    split_k = split_k_for(m, n, k, a.device) if split_k is None else split_k
    c = (
        torch.zeros(m, n, dtype=torch.float32, device=a.device)
        if split_k > 1
        else torch.empty(m, n, dtype=out_dtype, device=a.device)
    )
    if m:
        kernel[gemm_grid](
            a,
            w,
            c,
            a_scale.float().contiguous(),
            w_scale.float().contiguous(),
            bias,
            m,
            n,
            k,
            m_bucket(m),
            a.stride(0),
            w.stride(0),
            c.stride(0),
            HAS_BIAS=bias is not None,
            ACC_INT=a.dtype == torch.int8,
            SPLIT_K=split_k,
        )
    return c.to(out_dtype) if split_k > 1 else c


def int8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    split_k: int | None = None,
) -> torch.Tensor:
    """int8 a [M, K] x int8 w [N, K] with fp32 a_scale [M, 1] and w_scale [N] -> out_dtype [M, N]."""
    assert a.dtype == torch.int8 and w.dtype == torch.int8
    return launch_w8a8(_int8_kernel, a, a_scale, w, w_scale, bias, out_dtype, split_k)


def scaled_mm_ref(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Torch reference of the W8A8 GEMM (int8 or fp8 codes), accumulated in fp32."""
    c = (a.float() @ w.float().T) * a_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    if bias is not None:
        c = c + bias.float()
    return c.to(out_dtype)
