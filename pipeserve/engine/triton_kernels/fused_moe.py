"""Fused mixture of experts: routing, block alignment and two grouped GEMMs, no host sync anywhere.

1. topk_softmax: one program per token; softmax over the E router logits in fp32, the top_k
   (weights, expert ids) by repeated arg-max (lowest id on ties, like torch.topk), renormalized to
   sum to 1 when asked.
2. align_block_size: the T * top_k token/expert pairs sorted by expert and each expert's group padded
   to a multiple of BLOCK_M, so every BLOCK_M rows of the sorted list belong to one expert. One
   program per expert counts its pairs; a second pass has each expert scan the counts for its
   padded offset and write its pairs (in pair order) and its blocks' expert id. The padded total
   stays on the device: the GEMMs' grids are sized for the worst case (every expert's group ragged)
   and the programs past the total return at once.
3. moe_gemm, twice: a grouped GEMM where each program's BLOCK_M rows gather their tokens' inputs and
   multiply them by their one expert's weight tile. The gate/up GEMM computes the gate and up tiles
   together and writes silu(gate) * up; the down GEMM scales each row by its routing weight.
4. The top_k rows of every token summed (in fp32).
W8A8 (int8 / fp8 codes, per-token x per-channel scales) and W4A16 (int4 / nf4, gemm_w4a16.py's
layout per expert) variants of both GEMMs run the same routing and alignment.
Tiles are chosen on the host from the token count (BLOCK_M must match the alignment's), not
autotuned. Pair index p = token * top_k + k throughout; sorted slots past a group hold the sentinel
T * top_k, which no program loads or stores.
"""
# Triton reads a jit function's parameter annotations as its signature: its parameters stay untyped.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import compute_dtype, dot_precision, interpreting, pow2, tile_ids
from .gemm_w4a16 import nf4_lut
from .quantize import per_token_quant


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, stride_l, E, TOP_K: tl.constexpr,
                         RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * stride_l + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(offs < E, p / tl.sum(p, 0), -1.0)
    total = 0.0
    if RENORMALIZE:  # a first pass for the sum of the top_k
        q = p
        for _ in tl.static_range(TOP_K):
            best = tl.max(q, 0)
            total += best
            q = tl.where(offs == tl.min(tl.where(q == best, offs, BLOCK_E), 0), -1.0, q)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), 0)
        p = tl.where(offs == idx, -1.0, p)
        if RENORMALIZE:
            best = best / total
        tl.store(weights_ptr + row * TOP_K + k, best)
        tl.store(ids_ptr + row * TOP_K + k, idx)


def topk_softmax(router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights fp32 [T, top_k], expert ids int32 [T, top_k]), best first."""
    t, e = router_logits.shape
    assert top_k <= e and router_logits.stride(1) == 1
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    if t:
        _topk_softmax_kernel[(t,)](router_logits, weights, ids, router_logits.stride(0), e, TOP_K=top_k,
                                   RENORMALIZE=renormalize, BLOCK_E=pow2(e))
    return weights, ids


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr):
    expert = tl.program_id(0)
    count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        count += (ids == expert).to(tl.int32)
    tl.store(counts_ptr + expert, tl.sum(count, 0))


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, num_pairs, E,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr):
    expert = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + experts, mask=experts < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < expert, padded, 0), 0)
    own = tl.sum(tl.where(experts == expert, padded, 0), 0)
    if expert == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))
    for b in range(0, own // BLOCK_M):
        tl.store(expert_ids_ptr + start // BLOCK_M + b, expert)
    placed = start
    for first in range(0, num_pairs, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        mine = (tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1) == expert).to(tl.int32)
        rank = tl.cumsum(mine, 0)
        tl.store(sorted_ptr + placed + rank - 1, offs, mask=mine != 0)
        placed += tl.sum(mine, 0)


@dataclass
class Alignment:
    """The sorted, padded pair list of align_block_size, all on the device."""

    sorted_ids: torch.Tensor  # int32 [max_padded]: pair indices, each expert's group padded with num_pairs
    expert_ids: torch.Tensor  # int32 [max_padded // block_m]: the expert of each block (-1 past the total)
    num_padded: torch.Tensor  # int32 [1]: the padded total
    block_m: int


def align_block_size(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """ids [T, top_k] (int32) -> the pairs grouped by expert, each group padded to block_m."""
    flat = ids.reshape(-1)
    n = flat.numel()
    max_padded = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    device = ids.device
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=device)
    expert_ids = torch.full((max_padded // block_m,), -1, dtype=torch.int32, device=device)
    num_padded = torch.zeros(1, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    block = min(pow2(n, 16), 1024)
    _count_kernel[(num_experts,)](flat, counts, n, BLOCK=block)
    _place_kernel[(num_experts,)](flat, counts, sorted_ids, expert_ids, num_padded, n, num_experts,
                                  BLOCK_M=block_m, BLOCK_E=pow2(num_experts), BLOCK=block)
    return Alignment(sorted_ids, expert_ids, num_padded, block_m)


@triton.jit
def _block(sorted_ptr, expert_ids_ptr, pid_m, pid_n, num_pairs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The pairs of sorted block pid_m (and which are real, not padding), its expert, the columns."""
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    return pairs, pairs < num_pairs, expert, pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, weights_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
                     N, K, EM, num_pairs, stride_am, stride_we, stride_wn, stride_cm,
                     ROWS_PER_A: tl.constexpr, SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                     COMPUTE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """c[p, :N] for every sorted pair p of this program's block: a[p // ROWS_PER_A] @ w[e]^T, with
    SILU_MUL silu(a @ w[e, :N]^T) * (a @ w[e, N:2N]^T), with MUL_WEIGHT times the pair's weight."""
    pid_m, pid_n = tile_ids(tl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs, valid, expert, rn = _block(sorted_ptr, expert_ids_ptr, pid_m, pid_n, num_pairs, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // ROWS_PER_A).to(tl.int64)[:, None] * stride_am + rk[None, :]
    # Columns past N wrap onto valid ones (no load mask); their results are not stored.
    w_ptrs = w_ptr + expert * stride_we + (rn % N).to(tl.int64)[None, :] * stride_wn + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=valid[:, None] & ((k0 + rk)[None, :] < K), other=0.0).to(COMPUTE)
        w = tl.load(w_ptrs, mask=(k0 + rk)[:, None] < K, other=0.0)
        acc = tl.dot(a, w.to(COMPUTE), acc, input_precision=PRECISION)
        if SILU_MUL:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=(k0 + rk)[:, None] < K, other=0.0)
            acc_up = tl.dot(a, w_up.to(COMPUTE), acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _moe_epilogue(c_ptr, acc, acc_up, pairs, valid, rn, N, stride_cm, weights_ptr, SILU_MUL, MUL_WEIGHT)


@triton.jit
def _moe_epilogue(c_ptr, acc, acc_up, pairs, valid, rn, N, stride_cm, weights_ptr, SILU_MUL: tl.constexpr,
                  MUL_WEIGHT: tl.constexpr):
    """silu(gate) * up (SILU_MUL), times the pair's routing weight (MUL_WEIGHT), stored at the pairs'
    rows."""
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (rn < N)[None, :])


@triton.jit
def _moe_gemm_w8a8_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, c_ptr, weights_ptr, sorted_ptr,
                          expert_ids_ptr, num_padded_ptr, N, K, EM, num_pairs, stride_am, stride_we,
                          stride_wn, stride_se, stride_cm, ROWS_PER_A: tl.constexpr, SILU_MUL: tl.constexpr,
                          MUL_WEIGHT: tl.constexpr, ACC_INT: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """_moe_gemm_kernel on int8 / fp8 codes: a per-row scale of a, a per-(expert, column) scale of w."""
    pid_m, pid_n = tile_ids(tl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs, valid, expert, rn = _block(sorted_ptr, expert_ids_ptr, pid_m, pid_n, num_pairs, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_rows = tl.where(valid, pairs // ROWS_PER_A, 0).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + expert * stride_we + (rn % N).to(tl.int64)[None, :] * stride_wn + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32 if ACC_INT else tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.int32 if ACC_INT else tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(k0 + rk)[None, :] < K, other=0.0)
        w = tl.load(w_ptrs, mask=(k0 + rk)[:, None] < K, other=0.0)
        # out_dtype: the accumulator's (int32 for int8), which Triton 3.6 does not infer.
        acc = tl.dot(a, w, acc, out_dtype=acc.dtype)
        if SILU_MUL:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=(k0 + rk)[:, None] < K, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, out_dtype=acc_up.dtype)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    a_scale = tl.load(a_scale_ptr + a_rows)[:, None]
    w_scale_ptrs = w_scale_ptr + expert * stride_se + rn % N
    gate = acc.to(tl.float32) * a_scale * tl.load(w_scale_ptrs)[None, :]
    up = gate
    if SILU_MUL:
        up = acc_up.to(tl.float32) * a_scale * tl.load(w_scale_ptrs + N)[None, :]
    _moe_epilogue(c_ptr, gate, up, pairs, valid, rn, N, stride_cm, weights_ptr, SILU_MUL, MUL_WEIGHT)


@triton.jit
def _moe_gemm_w4a16_kernel(a_ptr, qw_ptr, scale_ptr, zero_ptr, lut_ptr, c_ptr, weights_ptr, sorted_ptr,
                           expert_ids_ptr, num_padded_ptr, N, K, K_A, EM, num_pairs, stride_am, stride_qe,
                           stride_qk, stride_se, stride_sg, stride_cm, QGROUP: tl.constexpr,
                           NF4: tl.constexpr, ROWS_PER_A: tl.constexpr, SILU_MUL: tl.constexpr,
                           HALVES: tl.constexpr, MUL_WEIGHT: tl.constexpr, COMPUTE: tl.constexpr,
                           PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """_moe_gemm_kernel on 4-bit weights (gemm_w4a16.py's layout per expert), dequantized in the loop.
    K is the weights' padded depth, K_A the activations' own (the columns past it count as zeros)."""
    pid_m, pid_n = tile_ids(tl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs, valid, expert, rn = _block(sorted_ptr, expert_ids_ptr, pid_m, pid_n, num_pairs, BLOCK_M, BLOCK_N)
    rn_safe = rn % N
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    a_rows = (pairs // ROWS_PER_A).to(tl.int64)
    qw_base = qw_ptr + expert * stride_qe
    s_base = scale_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + (k0 + rk)[None, :],
                    mask=valid[:, None] & ((k0 + rk)[None, :] < K_A), other=0.0).to(COMPUTE)
        g = k0 // QGROUP
        for half in tl.static_range(HALVES):  # gate (and up, with SILU_MUL) columns
            cols = rn_safe + half * N
            words = tl.load(qw_base + (k0 // 8 + rw)[:, None] * stride_qk + cols[None, :])
            codes = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
            scale = tl.load(s_base + g * stride_sg + cols).to(tl.float32)
            if NF4:
                w = tl.load(lut_ptr + codes) * scale[None, :]
            else:
                zero = tl.load(zero_ptr + expert * stride_se + g * stride_sg + cols).to(tl.float32)
                w = (codes.to(tl.float32) - zero[None, :]) * scale[None, :]
            if half == 0:
                acc = tl.dot(a, w.to(COMPUTE), acc, input_precision=PRECISION)
            else:
                acc_up = tl.dot(a, w.to(COMPUTE), acc_up, input_precision=PRECISION)
    _moe_epilogue(c_ptr, acc, acc_up, pairs, valid, rn, N, stride_cm, weights_ptr, SILU_MUL, MUL_WEIGHT)


@dataclass(frozen=True)
class MoETiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int


def moe_tiles(num_pairs: int, num_experts: int) -> MoETiles:
    """Short tiles when the pairs are few per expert (decode): a 64-row tile of a group of 2 is
    mostly padding. The interpreter takes small tiles: it runs every program's lanes on the CPU."""
    if interpreting():
        return MoETiles(16, 32, 32, 1)
    if num_pairs <= 8 * num_experts:
        return MoETiles(16, 64, 64, 1)
    return MoETiles(64, 64, 64, 8)


def moe_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, align: Alignment, tiles: MoETiles,
             rows_per_a: int, weights: torch.Tensor | None = None, silu_mul: bool = False) -> None:
    """out [pairs, N] = grouped a[p // rows_per_a] @ w[expert(p)]^T (w [E, N or 2N, K]); see
    _moe_gemm_kernel for silu_mul and the routing weights."""
    n, k = out.shape[1], a.shape[1]
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1 and w.shape[2] == k
    assert w.shape[1] == (2 * n if silu_mul else n)
    em = align.sorted_ids.shape[0]
    compute = compute_dtype(a.dtype)
    grid = (triton.cdiv(em, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    _moe_gemm_kernel[grid](
        a, w, out, weights, align.sorted_ids, align.expert_ids, align.num_padded,
        n, k, em, out.shape[0], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROWS_PER_A=rows_per_a, SILU_MUL=silu_mul, MUL_WEIGHT=weights is not None, COMPUTE=compute,
        PRECISION=dot_precision(compute), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
    )  # fmt: skip


def _route(x: torch.Tensor, router_logits: torch.Tensor, num_experts: int, top_k: int,
           renormalize: bool) -> tuple[torch.Tensor, Alignment, MoETiles]:
    weights, ids = topk_softmax(router_logits.contiguous(), top_k, renormalize)
    tiles = moe_tiles(x.shape[0] * top_k, num_experts)
    return weights, align_block_size(ids, num_experts, tiles.block_m), tiles


def _grid(align: Alignment, tiles: MoETiles, n: int) -> tuple[int]:
    return (triton.cdiv(align.sorted_ids.shape[0], tiles.block_m) * triton.cdiv(n, tiles.block_n),)


def _sum_top_k(out: torch.Tensor, tokens: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    return out.view(tokens, top_k, -1).sum(1, dtype=torch.float32).to(dtype)


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              top_k: int, renormalize: bool) -> torch.Tensor:
    """The fused_moe op (backend/__init__.py): x [T, H], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]."""
    t, hidden = x.shape
    if t == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    weights, align, tiles = _route(x, router_logits, w13.shape[0], top_k, renormalize)
    act = torch.empty(t * top_k, w2.shape[2], dtype=x.dtype, device=x.device)
    moe_gemm(x, w13, act, align, tiles, rows_per_a=top_k, silu_mul=True)
    out = torch.empty(t * top_k, hidden, dtype=x.dtype, device=x.device)
    moe_gemm(act, w2, out, align, tiles, rows_per_a=1, weights=weights)
    return _sum_top_k(out, t, top_k, x.dtype)


def _w8a8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
               out: torch.Tensor, align: Alignment, tiles: MoETiles, rows_per_a: int,
               weights: torch.Tensor | None = None, silu_mul: bool = False) -> None:
    n, k = out.shape[1], a.shape[1]
    assert a.dtype == w.dtype and w.stride(2) == 1 and w_scale.stride(1) == 1 and w.shape[2] == k
    _moe_gemm_w8a8_kernel[_grid(align, tiles, n)](
        a, a_scale, w, w_scale, out, weights, align.sorted_ids, align.expert_ids, align.num_padded,
        n, k, align.sorted_ids.shape[0], out.shape[0], a.stride(0), w.stride(0), w.stride(1),
        w_scale.stride(0), out.stride(0), ROWS_PER_A=rows_per_a, SILU_MUL=silu_mul,
        MUL_WEIGHT=weights is not None, ACC_INT=a.dtype == torch.int8, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
    )  # fmt: skip


def fused_moe_w8a8(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                   w2: torch.Tensor, w2_scale: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """fused_moe on int8 / fp8 experts: x quantized per token once (each pair's row reads its
    token's codes), the SiLU-and-mul output per pair before the down GEMM."""
    t, hidden = x.shape
    if t == 0:
        return torch.empty_like(x)
    weights, align, tiles = _route(x, router_logits, w13.shape[0], top_k, renormalize)
    a, a_scale = per_token_quant(x.contiguous(), w13.dtype)
    act = torch.empty(t * top_k, w2.shape[2], dtype=x.dtype, device=x.device)
    _w8a8_gemm(a, a_scale, w13, w13_scale, act, align, tiles, top_k, silu_mul=True)
    b, b_scale = per_token_quant(act, w2.dtype)
    out = torch.empty(t * top_k, hidden, dtype=x.dtype, device=x.device)
    _w8a8_gemm(b, b_scale, w2, w2_scale, out, align, tiles, 1, weights=weights)
    return _sum_top_k(out, t, top_k, x.dtype)


def _w4a16_gemm(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                out: torch.Tensor, align: Alignment, tiles: MoETiles, rows_per_a: int,
                weights: torch.Tensor | None = None, silu_mul: bool = False) -> None:
    n, k = out.shape[1], qweight.shape[1] * 8
    group = k // scales.shape[1]
    # A K tile must lie in one quantization group: the largest power of two dividing both.
    block_k = math.gcd(tiles.block_k, group)
    assert a.shape[1] <= k and a.stride(1) == 1 and qweight.stride(2) == 1 and block_k >= 8
    assert zeros is None or zeros.stride() == scales.stride()
    compute = compute_dtype(a.dtype)
    _moe_gemm_w4a16_kernel[_grid(align, tiles, n)](
        a, qweight, scales, zeros, nf4_lut(a.device), out, weights, align.sorted_ids, align.expert_ids,
        align.num_padded, n, k, a.shape[1], align.sorted_ids.shape[0], out.shape[0], a.stride(0),
        qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1), out.stride(0),
        QGROUP=group, NF4=zeros is None, ROWS_PER_A=rows_per_a, SILU_MUL=silu_mul,
        HALVES=2 if silu_mul else 1, MUL_WEIGHT=weights is not None, COMPUTE=compute,
        PRECISION=dot_precision(compute), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k,
        GROUP_M=tiles.group_m,
    )  # fmt: skip


def fused_moe_w4a16(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w13_scales: torch.Tensor,
                    w13_zeros: torch.Tensor | None, w2: torch.Tensor, w2_scales: torch.Tensor,
                    w2_zeros: torch.Tensor | None, top_k: int, renormalize: bool) -> torch.Tensor:
    """fused_moe on 4-bit experts (int4 with zero points, or nf4): float activations, the weights
    dequantized in the GEMMs' inner loops."""
    t, hidden = x.shape
    if t == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    weights, align, tiles = _route(x, router_logits, w13.shape[0], top_k, renormalize)
    act = torch.empty(t * top_k, w13.shape[2] // 2, dtype=x.dtype, device=x.device)
    _w4a16_gemm(x, w13, w13_scales, w13_zeros, act, align, tiles, top_k, silu_mul=True)
    out = torch.empty(t * top_k, hidden, dtype=x.dtype, device=x.device)
    _w4a16_gemm(act, w2, w2_scales, w2_zeros, out, align, tiles, 1, weights=weights)
    return _sum_top_k(out, t, top_k, x.dtype)
