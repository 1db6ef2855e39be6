"""The paged KV cache in Triton: the kernel that (quantizes and) writes new K/V rows into their slots,
and the tile loader both attention kernels read (and dequantize) the cache with.

Cache [P, S, Hkv, D]; int8 / fp8 caches carry a scale [P, S, Hkv, D // QGROUP] in fp16 (the format
and its torch quantizer: pipeserve/engine/quantization/kv_cache.py). Negative slots are skipped
(padding rows).
A kernel receives the whole cache as one `PagedKV` argument (tensors and strides).
"""
# Triton reads a jit function's parameter annotations as its signature: its parameters stay untyped.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"


from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from pipeserve.engine.quantization.formats import QMAX

from .common import check_fp8, pow2
from .quantize import inverse, to_codes


class PagedKV(NamedTuple):
    """K and V caches (one layout, checked) with their scales, as one kernel argument."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    strides: tuple[int, ...]  # page, slot, head of k and v
    scale_strides: tuple[int, ...]  # page, slot, head of the scales; zeros without them


def paged_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[PagedKV, dict[str, Any]]:
    """The cache argument and the constexprs that describe it (PAGE_SIZE, QUANT, QGROUP)."""
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need the same layout with contiguous channels")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale or neither")
    check_fp8(k_cache.dtype, k_cache.device)
    group = 0
    scale_strides: tuple[int, ...] = (0, 0, 0)
    if k_scale is not None and v_scale is not None:
        if k_scale.stride() != v_scale.stride() or k_scale.stride(-1) != 1:
            raise ValueError("k_scale and v_scale need the same layout with contiguous groups")
        d = k_cache.shape[-1]
        group = d // k_scale.shape[-1]
        if group * k_scale.shape[-1] != d or group & (group - 1):
            raise ValueError(f"KV scale {tuple(k_scale.shape)} does not split head_dim {d} into pow2 groups")
        scale_strides = k_scale.stride()[:3]
    cache = PagedKV(k_cache, v_cache, k_scale, v_scale, k_cache.stride()[:3], scale_strides)
    return cache, {"PAGE_SIZE": k_cache.shape[1], "QUANT": group > 0, "QGROUP": max(group, 1)}


@triton.jit
def token_offsets(cache, page, slot, head):
    """Offsets of tokens (page, slot) of one head in the caches and in their scales."""
    page = page.to(tl.int64)
    off = page * cache.strides[0] + slot * cache.strides[1] + head * cache.strides[2]
    soff = page * cache.scale_strides[0] + slot * cache.scale_strides[1] + head * cache.scale_strides[2]
    return off, soff


@triton.jit
def load_kv_tile(cache_ptr, scale_ptr, off, soff, n_mask, d, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, QUANT: tl.constexpr, QGROUP: tl.constexpr):
    """[BLOCK_N, BLOCK_D] tile at token offsets off (token_offsets): in the cache dtype, or in fp32
    dequantized when QUANT. Masked rows and padded channels are 0."""
    mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(cache_ptr + off[:, None] + d[None, :], mask=mask, other=0.0)
    if QUANT:
        NG: tl.constexpr = BLOCK_D // QGROUP
        g = tl.arange(0, NG)
        smask = n_mask[:, None] & (g < HEAD_DIM // QGROUP)[None, :]
        s = tl.load(scale_ptr + soff[:, None] + g[None, :], mask=smask, other=0).to(tl.float32)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, NG, QGROUP)), (BLOCK_N, BLOCK_D))
        x = x.to(tl.float32) * s
    return x


@triton.jit
def _store_rows(x_ptr, x_stride_h, cache, cache_ptr, scale_ptr, off, soff, h, h_mask, d,
                HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                QUANT: tl.constexpr, QGROUP: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr):
    """One token's heads [BLOCK_H, BLOCK_D] at x_ptr into cache_ptr (and scale_ptr) at off (soff)."""
    mask = h_mask[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(x_ptr + h[:, None] * x_stride_h + d[None, :], mask=mask, other=0)
    if QUANT:
        NG: tl.constexpr = BLOCK_D // QGROUP
        xg = tl.reshape(x.to(tl.float32), (BLOCK_H, NG, QGROUP))
        # Round the scale to fp16 first: the stored scale is exactly the one quantized with.
        s = (tl.max(tl.abs(xg), axis=2) * (1.0 / QMAX)).to(tl.float16).to(tl.float32)
        x = tl.reshape(to_codes(xg * inverse(s)[:, :, None], IS_INT8), (BLOCK_H, BLOCK_D))
        g = tl.arange(0, NG)
        smask = h_mask[:, None] & (g < HEAD_DIM // QGROUP)[None, :]
        sptrs = scale_ptr + soff + h[:, None] * cache.scale_strides[2] + g[None, :]
        tl.store(sptrs, s.to(tl.float16), mask=smask)
    ptrs = cache_ptr + off + h[:, None] * cache.strides[2] + d[None, :]
    tl.store(ptrs, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, cache, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, QGROUP: tl.constexpr,
                     QMAX: tl.constexpr, IS_INT8: tl.constexpr):
    t = tl.program_id(0)
    slot_id = tl.load(slot_ptr + t)
    valid = slot_id >= 0
    slot_id = tl.maximum(slot_id, 0)
    off, soff = token_offsets(cache, slot_id // PAGE_SIZE, slot_id % PAGE_SIZE, 0)
    h = tl.arange(0, BLOCK_H)
    h_mask = h < tl.where(valid, NUM_HEADS, 0)  # (a scalar & a vector mask trips the interpreter)
    d = tl.arange(0, BLOCK_D)
    _store_rows(k_ptr + t * stride_kt, stride_kh, cache, cache.k, cache.k_scale, off, soff, h, h_mask, d,
                HEAD_DIM, BLOCK_H, BLOCK_D, QUANT, QGROUP, QMAX, IS_INT8)
    _store_rows(v_ptr + t * stride_vt, stride_vh, cache, cache.v, cache.v_scale, off, soff, h, h_mask, d,
                HEAD_DIM, BLOCK_H, BLOCK_D, QUANT, QGROUP, QMAX, IS_INT8)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """The store_kv op: k/v [T, Hkv, D] into their cache slots (quantized with scales)."""
    t, num_heads, head_dim = k.shape
    if t == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k/v need contiguous channels"
    cache, layout = paged_kv(k_cache, v_cache, k_scale, v_scale)
    _store_kv_kernel[(t,)](
        k, v, cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=pow2(num_heads), BLOCK_D=pow2(head_dim),
        QMAX=QMAX.get(k_cache.dtype, 1.0), IS_INT8=k_cache.dtype == torch.int8, **layout,
    )  # fmt: skip
