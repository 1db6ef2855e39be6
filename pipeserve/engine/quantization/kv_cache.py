"""The quantized KV cache, in one place: its format, the torch quantize / dequantize of it, and the
per-sequence key shift that makes keys quantize well. The Triton store kernel and tile loader that
read and write the same format are in pipeserve/engine/triton_kernels/kv_cache.py.

Format (`--kv-cache-dtype int8|fp8`): symmetric, one fp16 scale per group of consecutive channels of
a token's head (GROUP = 8; a head_dim that is not a multiple of it is one group). The group size lives
in the scale tensor's shape: group = D // scale.shape[-1].
- int8: scale = max|x| / 127, q = round(x / scale) (half away from zero), clamped to [-127, 127].
- fp8 (float8_e4m3fn): scale = max|x| / 448, q = fp8(x / scale).
The scale is rounded to fp16 before dividing, so the stored scale is exactly the one used.
Keys are stored less their sequence's mean key (key_means; SageAttention's K smoothing).
"""

from __future__ import annotations

import torch

from pipeserve.engine.kv.metadata import AttentionMetadata
from pipeserve.engine.quantization.formats import QMAX, safe_inverse, to_codes

KV_QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
GROUP = 8
# Caches that store keys less their sequence's mean key (key_means).
K_SMOOTHED = frozenset(KV_QUANT_DTYPES)


def scale_group(head_dim: int) -> int:
    """The channel group a pool of this head_dim quantizes with."""
    return GROUP if head_dim % GROUP == 0 else head_dim


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] of dtype, scale fp16 [..., D // group])."""
    d = x.shape[-1]
    if d % group:
        raise ValueError(f"head_dim {d} is not a multiple of the KV quantization group {group}")
    xg = x.float().reshape(*x.shape[:-1], d // group, group)
    scale = (xg.abs().amax(-1) * (1.0 / QMAX[dtype])).to(torch.float16)  # as per_row_quant
    return to_codes(xg * safe_inverse(scale)[..., None], dtype).flatten(-2), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., D], scale [..., D // group] -> fp32 [..., D]."""
    groups = scale.shape[-1]
    grouped = q.float().reshape(*q.shape[:-1], groups, q.shape[-1] // groups)
    return (grouped * scale.float()[..., None]).flatten(-2)


def rope_mean(x: torch.Tensor, cos_sin: torch.Tensor, horizon: torch.Tensor) -> torch.Tensor:
    """x [B, H, D] (before RoPE) -> the mean over positions p < horizon [B] of x rotated to p, in fp32.

    RoPE is linear, so this is x under the mean rotation: per frequency w (read from the table the
    model rotates with), mean_p cos(p w) = sin(L w / 2) cos((L - 1) w / 2) / (L sin(w / 2)) and
    likewise for sin; channels past the table's width are not rotated."""
    half = cos_sin.shape[-1] // 2
    row = cos_sin[min(1, cos_sin.shape[0] - 1)].double()
    hw = torch.atan2(row[half:], row[:half]) / 2  # w / 2 per frequency, w < pi
    big_l = horizon.double()[:, None]
    sin_hw = torch.sin(hw)
    ratio = torch.where(sin_hw.abs() > 1e-12, torch.sin(big_l * hw) / (big_l * sin_hw), 1.0)
    mean_cos = (ratio * torch.cos((big_l - 1) * hw)).float()[:, None]
    mean_sin = (ratio * torch.sin((big_l - 1) * hw)).float()[:, None]
    x = x.float()
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat([x1 * mean_cos - x2 * mean_sin, x2 * mean_cos + x1 * mean_sin, x[..., 2 * half :]], -1)


def key_means(k: torch.Tensor, k_means: torch.Tensor, seq_of_page: torch.Tensor, meta: AttentionMetadata,
              cos_sin: torch.Tensor) -> torch.Tensor:
    """The vector m [T, Hkv, D] that each key row's sequence stores its keys less of (after RoPE);
    k [T, Hkv, D] are the keys before RoPE, decode rows first.

    softmax(q.k) is unchanged when every key a query sees moves by the same m (q.m is one constant
    per query), so attention needs nothing. But trained models' keys carry a large per-channel bias
    (|mean| up to ~20 against a spread of ~3 in stories260K) and fp8 keeps a fixed relative precision
    of each element (3 mantissa bits), so quantizing k - m costs far less than quantizing k.

    m is fixed for a sequence's life and set by its first chunk (the one at position 0) before that
    chunk is stored: the chunk's mean key before RoPE, b, taken to its mean over the positions the
    sequence is expected to span, L = max(chunk length, half the context): mean_{p<L} RoPE_p(b).
    Channel pairs that rotate little over L keep their bias in m; fast ones average out of it, as
    they do out of the keys (a bias frozen at early positions would add error to later keys). m lives
    in the request slot's row of k_means [max_num_seqs, Hkv, D]; a preempted request recomputes
    from position 0 and so sets it again. The slot of a row is seq_of_page [P] at the first page of
    its block table. No host syncs, no per-request loop."""
    nd, t = meta.num_decode, k.shape[0]
    if t == nd:  # decode only: one row per sequence
        return k_means.index_select(0, seq_of_page.index_select(0, meta.decode_block_tables[:, 0]))
    first_pages = torch.cat([meta.decode_block_tables[:, 0], meta.prefill_block_tables[:, 0]])
    seq_slots = seq_of_page.index_select(0, first_pages).long()  # [Bd + Bp]
    q_lens = (meta.prefill_cu_q_lens[1:] - meta.prefill_cu_q_lens[:-1]).long()
    bp = q_lens.shape[0]
    seq_of_row = torch.repeat_interleave(torch.arange(bp, device=k.device), q_lens, output_size=t - nd)
    sums = torch.zeros(bp, *k.shape[1:], device=k.device).index_add_(0, seq_of_row, k[nd:].float())
    bias = sums / q_lens.clamp(min=1)[:, None, None]
    horizon = q_lens.clamp(min=max(1, cos_sin.shape[0] // 2))
    first = (meta.prefill_seq_lens.long() == q_lens)[:, None, None]  # the chunk starts at position 0
    p_slots = seq_slots[nd:]
    new = rope_mean(bias, cos_sin, horizon).to(k_means.dtype)
    k_means.index_copy_(0, p_slots, torch.where(first, new, k_means.index_select(0, p_slots)))
    row_seq = torch.cat([torch.arange(nd, device=k.device), nd + seq_of_row])  # decode: one row each
    return k_means.index_select(0, seq_slots.index_select(0, row_seq))
