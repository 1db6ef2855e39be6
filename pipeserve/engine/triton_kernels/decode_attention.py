"""Decoding attention (q length 1) over the paged KV cache, flash-decoding style.

Stage 1, grid (batch, kv head, split): the query heads sharing one KV head form the rows of one
tl.dot tile (padded to 16 rows, the GPU's minimum), the request's KV range [window start, seq_len)
is cut into NUM_SPLITS equal pieces computed on the device from its own length (the grid depends only
on the batch shape, so CUDA graphs can capture it), each piece runs an online softmax over BLOCK_N
tokens at a time gathered through the block table, dequantizing an int8 / fp8 cache on the fly.
Stage 2, grid (batch, q head): merge the partial outputs by their log-sum-exp. With one split stage 1
writes the output directly.
"""
# Triton reads a jit function's parameter annotations as its signature: its parameters stay untyped.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"


from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import LOG2E, attend, kernel_inputs, window_arg
from .common import interpreting, pow2, sm_count

MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the extra parallelism
MAX_SPLITS = 16


@triton.jit
def _decode_kernel(q_ptr, cache, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   sm_scale_log2, window, stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, QUANT: tl.constexpr, QGROUP: tl.constexpr, COMPUTE: tl.constexpr,
                   PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = tl.maximum(seq_len - window, 0)  # window: the sliding window, or 2**30 without one
    per_split = tl.cdiv(tl.cdiv(seq_len - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    q_head = kv_head * GROUP + h
    hd_mask = (h < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b * stride_qb + q_head[:, None] * stride_qh + d[None, :], mask=hd_mask, other=0)
    q_pos = tl.zeros([BLOCK_H], tl.int32) + seq_len - 1

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    # Masked: a split's last block may run past its end into the next split's keys.
    acc, m_i, l_i = attend(acc, m_i, l_i, q.to(COMPUTE), q_pos, cache, table, kv_head, d, lo, hi, window,
                           sm_scale_log2, HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, QUANT, QGROUP, COMPUTE,
                           PRECISION, True)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + b * stride_ob + q_head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        # Workspace [B, Hq, NUM_SPLITS, BLOCK_D] and [B, Hq, NUM_SPLITS]; an empty split has lse -inf.
        row = (b * (tl.num_programs(1) * GROUP) + q_head) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], out, mask=hd_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=h < GROUP)


@triton.jit
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    row = (b * tl.num_programs(1) + head) * NUM_SPLITS
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + row + s, mask=s < NUM_SPLITS, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 always holds a key, so the max is finite
    parts = tl.load(
        part_out_ptr + (row + s)[:, None] * BLOCK_D + d[None, :],
        mask=(s < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :],
        other=0,
    )
    out = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM
    )


def num_splits_for(batch: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Enough (batch x kv head x split) programs to fill the GPU a few times over, never splits
    shorter than MIN_SPLIT_TOKENS of the longest possible context."""
    by_len = max(1, max_len // MIN_SPLIT_TOKENS)
    by_occupancy = int(triton.cdiv(4 * sm_count(device), max(1, batch * num_kv_heads)))
    return max(1, min(MAX_SPLITS, by_len, by_occupancy))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """The decode_attention op. q [Bd, Hq, D] -> [Bd, Hq, D]. max_seq_len (host) only sizes the split
    count; without it the block table's width bounds the length, so nothing is read back from the
    device."""
    batch, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if batch == 0:
        return out
    cache, consts = kernel_inputs(q, k_cache, v_cache, k_scale, v_scale)
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * k_cache.shape[1]
        num_splits = num_splits_for(batch, num_kv_heads, bound, q.device)
    block_d = pow2(head_dim, 16)
    if num_splits > 1:
        part_out = torch.empty(batch, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, cache, block_tables, seq_lens, out, part_out, part_lse, scale * LOG2E, window_arg(sliding_window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_H=pow2(group, 16),
        BLOCK_N=16 if interpreting() else 64, BLOCK_D=block_d, num_warps=4, num_stages=2,
        **consts,
    )  # fmt: skip
    if num_splits > 1:
        _merge_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=pow2(num_splits), BLOCK_D=block_d, num_warps=1,
        )  # fmt: skip
    return out
