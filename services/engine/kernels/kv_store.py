"""The paged KV cache format in Triton: the kernel that (quantizes and) writes new K/V rows into their
slots, and the tile loader the attention kernels read (and dequantize) the cache with.

Cache [P, S, Hkv, D]; int8 / fp8 caches carry a scale [P, S, Hkv, D // QGROUP] in fp16 (format and
torch reference: services/engine/ops/kv_quant.py). Negative slots are skipped (padding rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.ops.kv_quant import QMAX

from .common import pow2
from .quant import inverse, to_codes


@triton.jit
def load_kv_tile(
    cache_ptr,
    scale_ptr,
    page,
    slot,
    head,
    n_mask,
    d,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_sp,
    stride_ss,
    stride_sh,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    QGROUP: tl.constexpr,
):
    """[BLOCK_N, BLOCK_D] tile of one KV head at tokens (page, slot): in the cache dtype, or in fp32
    dequantized when QUANT. Masked rows and padded channels are 0."""
    page = page.to(tl.int64)
    base = page * stride_cp + slot * stride_cs + head * stride_ch
    mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(cache_ptr + base[:, None] + d[None, :], mask=mask, other=0.0)
    if QUANT:
        NG: tl.constexpr = BLOCK_D // QGROUP
        g = tl.arange(0, NG)
        sbase = page * stride_sp + slot * stride_ss + head * stride_sh
        smask = n_mask[:, None] & (g < HEAD_DIM // QGROUP)[None, :]
        s = tl.load(scale_ptr + sbase[:, None] + g[None, :], mask=smask, other=0).to(tl.float32)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, NG, QGROUP)), (BLOCK_N, BLOCK_D))
        x = x.to(tl.float32) * s
    return x


@triton.jit
def _store_rows(
    x_ptr,
    stride_xt,
    stride_xh,
    cache_ptr,
    scale_ptr,
    t,
    page,
    slot,
    valid,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_sp,
    stride_ss,
    stride_sh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    QGROUP: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT8: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = h < tl.where(valid, NUM_HEADS, 0)  # (a scalar & a vector mask trips the interpreter)
    mask = h_mask[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :], mask=mask, other=0)
    base = page.to(tl.int64) * stride_cp + slot * stride_cs
    if QUANT:
        NG: tl.constexpr = BLOCK_D // QGROUP
        xg = tl.reshape(x.to(tl.float32), (BLOCK_H, NG, QGROUP))
        # Round the scale to fp16 first: the stored scale is exactly the one quantized with.
        s = (tl.max(tl.abs(xg), axis=2) / QMAX).to(tl.float16).to(tl.float32)
        y = to_codes(xg * inverse(s)[:, :, None], IS_INT8)
        y = tl.reshape(y, (BLOCK_H, BLOCK_D))
        g = tl.arange(0, NG)
        smask = h_mask[:, None] & (g < HEAD_DIM // QGROUP)[None, :]
        sbase = page.to(tl.int64) * stride_sp + slot * stride_ss
        tl.store(scale_ptr + sbase + h[:, None] * stride_sh + g[None, :], s.to(tl.float16), mask=smask)
        x = y
    tl.store(
        cache_ptr + base + h[:, None] * stride_ch + d[None, :], x.to(cache_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_sp,
    stride_ss,
    stride_sh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    QGROUP: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT8: tl.constexpr,
):
    t = tl.program_id(0)
    slot_id = tl.load(slot_ptr + t)
    valid = slot_id >= 0
    slot_id = tl.maximum(slot_id, 0)
    page = slot_id // PAGE_SIZE
    slot = slot_id % PAGE_SIZE
    _store_rows(
        k_ptr,
        stride_kt,
        stride_kh,
        k_cache_ptr,
        k_scale_ptr,
        t,
        page,
        slot,
        valid,
        stride_cp,
        stride_cs,
        stride_ch,
        stride_sp,
        stride_ss,
        stride_sh,
        NUM_HEADS,
        HEAD_DIM,
        BLOCK_H,
        BLOCK_D,
        QUANT,
        QGROUP,
        QMAX,
        IS_INT8,
    )
    _store_rows(
        v_ptr,
        stride_vt,
        stride_vh,
        v_cache_ptr,
        v_scale_ptr,
        t,
        page,
        slot,
        valid,
        stride_cp,
        stride_cs,
        stride_ch,
        stride_sp,
        stride_ss,
        stride_sh,
        NUM_HEADS,
        HEAD_DIM,
        BLOCK_H,
        BLOCK_D,
        QUANT,
        QGROUP,
        QMAX,
        IS_INT8,
    )


def kv_quant_group(k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> int:
    """The channel group of a quantized cache (from the scale's shape), 0 for a plain cache."""
    if k_scale is None:
        return 0
    d = k_cache.shape[-1]
    group = d // k_scale.shape[-1]
    if group * k_scale.shape[-1] != d or group & (group - 1):
        raise ValueError(f"KV scale {tuple(k_scale.shape)} does not split head_dim {d} into pow2 groups")
    return group


def check_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need the same layout with contiguous channels")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale or neither")
    if k_scale is not None and (k_scale.stride() != v_scale.stride() or k_scale.stride(-1) != 1):
        raise ValueError("k_scale and v_scale need the same layout with contiguous groups")


def scale_strides(k_scale: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if k_scale is None else k_scale.stride()[:3]


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Triton version of ops.attention.store_kv: k/v [T, Hkv, D] into their cache slots."""
    t, num_heads, head_dim = k.shape
    if t == 0:
        return
    check_cache(k_cache, v_cache, k_scale, v_scale)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k/v need contiguous channels"
    group = kv_quant_group(k_cache, k_scale)
    _store_kv_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *scale_strides(k_scale),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=pow2(num_heads),
        BLOCK_D=pow2(head_dim),
        QUANT=group > 0,
        QGROUP=max(group, 1),
        QMAX=QMAX.get(k_cache.dtype, 1.0),
        IS_INT8=k_cache.dtype == torch.int8,
    )
