"""RoPE applied in place on q and k (rotate-half / NeoX layout as HF Llama; the first rot_dim channels
rotate, the rest pass through). One program per token rotates all its q and k heads."""
# Triton reads a jit function's parameter annotations as its signature: its parameters stay untyped.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"


from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pow2


@triton.jit
def _rotate(
    base_ptr,
    stride_h,
    cos,
    sin,
    j,
    j_mask,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    mask = (h < NUM_HEADS)[:, None] & j_mask[None, :]
    ptrs = base_ptr + h[:, None] * stride_h + j[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0).to(tl.float32)
    dtype = base_ptr.dtype.element_ty
    tl.store(ptrs, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(ptrs + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + j, mask=j_mask, other=0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + j, mask=j_mask, other=0)[None, :]
    _rotate(q_ptr + t * stride_qt, stride_qh, cos, sin, j, j_mask, NUM_Q_HEADS, HALF, BLOCK_HQ)
    _rotate(k_ptr + t * stride_kt, stride_kh, cos, sin, j, j_mask, NUM_KV_HEADS, HALF, BLOCK_HKV)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """The apply_rope op: q [T, Hq, D], k [T, Hkv, D] rotated in place."""
    tokens = q.shape[0]
    if tokens == 0:
        return
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    half = cos_sin_cache.shape[-1] // 2
    _rope_kernel[(tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=q.shape[1],
        NUM_KV_HEADS=k.shape[1],
        HALF=half,
        BLOCK_HQ=pow2(q.shape[1]),
        BLOCK_HKV=pow2(k.shape[1]),
        BLOCK_HALF=pow2(half),
        num_warps=4,
    )
