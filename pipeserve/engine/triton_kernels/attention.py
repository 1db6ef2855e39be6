"""What the decode and prefill attention kernels share: the online-softmax loop over paged keys and
the launch-time constants that configure it."""
# Triton reads a jit function's parameter annotations as its signature: its parameters stay untyped.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"


from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .common import compute_dtype, dot_precision
from .kv_cache import PagedKV, load_kv_tile, paged_kv, token_offsets

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # the window of a layer without one


@triton.jit
def attend(acc, m_i, l_i, q, q_pos, cache, table, kv_head, d, lo, hi, window, sm_scale_log2,
           HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
           QUANT: tl.constexpr, QGROUP: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
           MASKED: tl.constexpr):
    """Online softmax (base 2) of the query rows q [R, BLOCK_D] at positions q_pos [R] over the keys
    [lo, hi) of one KV head, read BLOCK_N at a time through the block table `table`. Without MASKED
    every row sees every key of the range (lo and hi multiples of BLOCK_N); with it, row r sees keys
    q_pos[r] - window < pos <= q_pos[r] below hi."""
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < hi
        page = tl.load(table + pos // PAGE_SIZE, mask=n_mask, other=0)
        off, soff = token_offsets(cache, page, pos % PAGE_SIZE, kv_head)
        k = load_kv_tile(cache.k, cache.k_scale, off, soff, n_mask, d, HEAD_DIM, BLOCK_N, BLOCK_D, QUANT,
                         QGROUP)
        qk = tl.dot(q, tl.trans(k.to(COMPUTE)), input_precision=PRECISION) * sm_scale_log2
        if MASKED:
            seen = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
            qk = tl.where(seen & n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = load_kv_tile(cache.v, cache.v_scale, off, soff, n_mask, d, HEAD_DIM, BLOCK_N, BLOCK_D, QUANT,
                         QGROUP)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v.to(COMPUTE), input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


def kernel_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None) -> tuple[PagedKV, dict[str, Any]]:
    """The cache argument and the constexprs shared by both attention kernels: the cache's (PAGE_SIZE,
    QUANT, QGROUP) and the dot operand dtype and precision for q's dtype (COMPUTE, PRECISION)."""
    assert q.stride(-1) == 1
    cache, layout = paged_kv(k_cache, v_cache, k_scale, v_scale)
    compute = compute_dtype(q.dtype)
    return cache, {**layout, "COMPUTE": compute, "PRECISION": dot_precision(compute)}


def window_arg(sliding_window: int | None) -> int:
    return sliding_window or NO_WINDOW


