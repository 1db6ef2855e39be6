"""The reference backend: every op in plain torch, written to be obviously correct rather than fast.

It is the oracle the Triton kernels and the CPU backend are tested against. Attention walks the
paged cache token by token through the block table, one request at a time, and computes softmax
attention in fp32 with an explicit causal / sliding-window mask. The quantized GEMMs multiply the
dequantized operands in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pipeserve.engine.quantization.formats import dequantize_4bit, per_row_quant
from pipeserve.engine.quantization.kv_cache import dequantize_kv, quantize_kv

from .base import Backend, NormOut, NormQuantOut, QuantOut
from .lora_ops import add_lora, add_lora_slots  # noqa: F401 - an op of this backend (collected from vars())


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write new K/V rows [T, Hkv, D] into the paged cache [P, S, Hkv, D] at their slots. With
    k_scale/v_scale [P, S, Hkv, D // group] the cache is int8/fp8 and the rows are quantized."""
    if k.shape[0] == 0:
        return
    if k_scale is not None and v_scale is not None:
        for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            q, s = quantize_kv(x, cache.dtype, x.shape[-1] // scale.shape[-1])
            # As bytes: index_copy_ has no fp8 kernel on the CPU.
            as_bytes = cache.view(torch.uint8).view(-1, *cache.shape[2:])
            as_bytes.index_copy_(0, slot_mapping, q.view(torch.uint8))
            scale.view(-1, *scale.shape[2:]).index_copy_(0, slot_mapping, s)
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def read_kv(cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor,
            seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one request's K or V, [seq_len, Hkv, D] in fp32 (dequantized)."""
    page_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    slots = block_table.long()[pos // page_size] * page_size + pos % page_size
    rows = cache.flatten(0, 1).index_select(0, slots)
    if scale is None:
        return rows.float()
    return dequantize_kv(rows, scale.flatten(0, 1).index_select(0, slots))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
           sliding_window: int | None) -> torch.Tensor:
    """Softmax attention of queries q [Lq, Hq, D] at positions q_pos [Lq] over keys k / v [Lk, Hkv, D]
    at positions 0..Lk-1, each query seeing keys max(0, pos - window + 1) .. pos. fp32 [Lq, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    key_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    seen = key_pos <= q_pos[:, None]
    if sliding_window is not None:
        seen &= key_pos > q_pos[:, None] - sliding_window
    probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None = None, max_seq_len: int | None = None, *,
                     k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [Bd, Hq, D], one query per request at position seq_len - 1."""
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        k = read_kv(k_cache, k_scale, block_tables[i], seq_len)
        v = read_kv(v_cache, v_scale, block_tables[i], seq_len)
        q_pos = torch.tensor([seq_len - 1], device=q.device)
        out[i] = attend(q[i : i + 1], k, v, q_pos, scale, sliding_window)[0].to(q.dtype)
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor,
                      max_q_len: int, max_seq_len: int, scale: float,
                      sliding_window: int | None = None, *, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None,
                      new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [Tp, Hq, D]: chunk i holds rows cu_q_lens[i]:cu_q_lens[i+1], at positions ending at
    seq_len - 1; every key is read from the cache (new_kv is accepted and not needed)."""
    out = torch.empty_like(q)
    starts = cu_q_lens.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        k = read_kv(k_cache, k_scale, block_tables[i], seq_len)
        v = read_kv(v_cache, v_scale, block_tables[i], seq_len)
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
        out[lo:hi] = attend(q[lo:hi], k, v, q_pos, scale, sliding_window).to(q.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> NormOut:
    """Without residual: norm(x). With residual: (norm(x + residual), x + residual), as the
    pre-norm transformer block needs both. Accumulates in fp32 and scales in x's dtype, like HF."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, x)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> None:
    """q [T, Hq, D], k [T, Hkv, D] rotated in place at their positions, in fp32 as HF: the first
    rot_dim channels in rotate-half pairs (i, i + rot_dim / 2), the rest unchanged."""
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions][:, None, :]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x[..., : 2 * half] = rotated


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def per_token_quant(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> QuantOut:
    return per_row_quant(x, dtype)


def quantized_norm(out: NormOut, quant_dtype: torch.dtype) -> NormQuantOut:
    """rms_norm's result quantized per token, x + residual passed through."""
    if isinstance(out, torch.Tensor):
        return per_row_quant(out, quant_dtype)
    return (*per_row_quant(out[0], quant_dtype), out[1])


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None,
                   quant_dtype: torch.dtype = torch.int8) -> NormQuantOut:
    return quantized_norm(rms_norm(x, weight, eps, residual), quant_dtype)


def silu_and_mul_quant(x: torch.Tensor, quant_dtype: torch.dtype = torch.int8) -> QuantOut:
    return per_row_quant(silu_and_mul(x), quant_dtype)


def scaled_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The W8A8 GEMM (int8 or fp8 codes) on dequantized operands, accumulated in fp32."""
    c = (a.float() @ w.float().T) * a_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    if bias is not None:
        c = c + bias.float()
    return c.to(out_dtype)


def w4a16_gemm(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None = None) -> torch.Tensor:
    return (a.float() @ dequantize_4bit(qweight, scales, zeros).T).to(a.dtype)


def moe_route(router_logits: torch.Tensor, top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in fp32, the top_k of each token: (weights fp32 [T, k], expert ids
    int64 [T, k]), the weights rescaled to sum to 1 when renormalize."""
    weights, ids = router_logits.float().softmax(-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


ExpertMLP = Callable[[int, torch.Tensor], torch.Tensor]


def moe(x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool, hidden: int,
        expert_mlp: ExpertMLP) -> torch.Tensor:
    """One expert at a time: the rows routed to it through expert_mlp(e, rows) -> fp32 [n, hidden],
    added into the output with their routing weights."""
    weights, ids = moe_route(router_logits, top_k, renormalize)
    out = torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
    for e in range(router_logits.shape[1]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel():
            out.index_add_(0, token, expert_mlp(e, x.index_select(0, token)) * weights[token, slot, None])
    return out.to(x.dtype)


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              top_k: int, renormalize: bool) -> torch.Tensor:
    """Each expert's gated MLP in fp32."""
    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(rows.float() @ w13[e].float().T) @ w2[e].float().T

    return moe(x, router_logits, top_k, renormalize, w2.shape[1], mlp)


def fused_moe_w8a8(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                   w2: torch.Tensor, w2_scale: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """Each expert's MLP as two W8A8 GEMMs, their inputs quantized per token."""
    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        a, a_scale = per_row_quant(rows, w13.dtype)
        h = silu_and_mul(scaled_gemm(a, a_scale, w13[e], w13_scale[e], out_dtype=torch.float32))
        b, b_scale = per_row_quant(h, w2.dtype)
        return scaled_gemm(b, b_scale, w2[e], w2_scale[e], out_dtype=torch.float32)

    return moe(x, router_logits, top_k, renormalize, w2_scale.shape[1], mlp)


def fused_moe_w4a16(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w13_scales: torch.Tensor,
                    w13_zeros: torch.Tensor | None, w2: torch.Tensor, w2_scales: torch.Tensor,
                    w2_zeros: torch.Tensor | None, top_k: int, renormalize: bool) -> torch.Tensor:
    """Each expert's MLP on its dequantized 4-bit weights in fp32, the inputs zero-padded to them."""
    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        w_in = dequantize_4bit(w13[e], w13_scales[e], None if w13_zeros is None else w13_zeros[e])
        w_out = dequantize_4bit(w2[e], w2_scales[e], None if w2_zeros is None else w2_zeros[e])
        h = silu_and_mul(F.pad(rows.float(), (0, w_in.shape[1] - rows.shape[1])) @ w_in.T)
        return F.pad(h, (0, w_out.shape[1] - h.shape[1])) @ w_out.T

    return moe(x, router_logits, top_k, renormalize, w2.shape[2], mlp)


int8_gemm = fp8_gemm = scaled_gemm

BACKEND = Backend.collect("reference", vars())
