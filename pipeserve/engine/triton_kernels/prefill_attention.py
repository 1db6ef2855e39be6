"""Prefill attention: causal, variable-length flat batch, every key read from the paged cache (the
chunk's own K/V were stored first, earlier chunks are already there), optional sliding window, int8 /
fp8 cache dequantized on the fly.

FlashAttention-2 forward, grid (query block, sequence, q head): each program runs an online softmax
over BLOCK_N keys at a time. Key blocks that every row of the query block sees in full skip the mask;
only the blocks crossing the diagonal or the window edge pay for it.
"""
# Triton reads a jit function's parameter annotations as its signature: its parameters stay untyped.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"


from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import LOG2E, attend, kernel_inputs, window_arg
from .common import interpreting, pow2


@triton.jit
def _prefill_kernel(q_ptr, cache, block_tables_ptr, cu_q_lens_ptr, seq_lens_ptr, out_ptr, sm_scale_log2,
                    window, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    QUANT: tl.constexpr, QGROUP: tl.constexpr, COMPUTE: tl.constexpr,
                    PRECISION: tl.constexpr):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_q_lens_ptr + seq)
    q_len = tl.load(cu_q_lens_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // GROUP

    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    md_mask = (m < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=md_mask, other=0)
    q = q.to(COMPUTE)
    q_pos = seq_len - q_len + m

    # Keys [lo, hi) matter to this block; [full_lo, full_hi) are seen by every row, unmasked.
    first = seq_len - q_len + m_block * BLOCK_M
    last = tl.minimum(first + BLOCK_M, seq_len) - 1
    lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
    hi = last + 1
    full_hi = tl.maximum((first + 1) // BLOCK_N * BLOCK_N, lo)
    full_lo = tl.minimum(tl.cdiv(tl.maximum(last - window + 1, 0), BLOCK_N) * BLOCK_N, full_hi)
    full_lo = tl.maximum(full_lo, lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The unmasked middle first, then the window's edge and the diagonal, masked.
    for part in tl.static_range(3):
        if part == 0:
            start, end = full_lo, full_hi
        elif part == 1:
            start, end = lo, full_lo
        else:
            start, end = full_hi, hi
        acc, m_i, l_i = attend(acc, m_i, l_i, q, q_pos, cache, table, kv_head, d, start, end, window,
                               sm_scale_log2, HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, QUANT, QGROUP, COMPUTE,
                               PRECISION, part > 0)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=md_mask,
    )


def _tiles(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if interpreting():
        return 16, 16, 4, 1
    if head_dim <= 64:
        return 128, 64, 4, 3
    return 128, 64, 8, 3


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    max_q_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The prefill_attention op. q [Tp, Hq, D] -> [Tp, Hq, D]. new_kv is not read: the kernel streams
    every chunk's keys from the cache, where store_kv just wrote them."""
    tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    cache, consts = kernel_inputs(q, k_cache, v_cache, k_scale, v_scale)
    block_m, block_n, num_warps, num_stages = _tiles(head_dim)
    grid = (triton.cdiv(max_q_len, block_m), seq_lens.shape[0], num_heads)
    _prefill_kernel[grid](
        q, cache, block_tables, cu_q_lens, seq_lens, out, scale * LOG2E, window_arg(sliding_window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=pow2(head_dim, 16), num_warps=num_warps, num_stages=num_stages,
        **consts,
    )  # fmt: skip
    return out
