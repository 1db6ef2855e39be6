"""Attention over the paged KV cache: metadata and the torch reference implementations.

The flat batch holds decode rows first (q length 1) and prefill rows after. The reference path
gathers each request's pages into a padded tensor and runs one masked softmax per group; it is
exact and vectorised over the batch (no per-request loop), which is what the CPU needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_quant import dequantize_kv, quantize_kv


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]
    num_decode: int
    decode_block_tables: torch.Tensor  # int32 [Bd, max_pages]
    decode_seq_lens: torch.Tensor  # int32 [Bd]
    prefill_block_tables: torch.Tensor  # int32 [Bp, max_pages]
    prefill_cu_q_lens: torch.Tensor  # int32 [Bp + 1]
    prefill_seq_lens: torch.Tensor  # int32 [Bp]
    prefill_max_q_len: int
    prefill_max_seq_len: int

    @property
    def num_prefill_seqs(self) -> int:
        return int(self.prefill_seq_lens.shape[0])


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


def gather_pages(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """[P, S, H, D] cache and [B, max_pages] tables -> [B, max_len, H, D] (positions past a
    request's length hold whatever page 0 holds; callers mask them). A quantized cache comes with
    its scale [P, S, H, D // group] and is returned dequantized in fp32."""
    page_size = cache.shape[1]
    pages = (max_len + page_size - 1) // page_size
    out = cache[block_tables[:, :pages].long()]  # [B, pages, S, H, D]
    if scale is not None:
        out = dequantize_kv(out, scale[block_tables[:, :pages].long()])
    return out.flatten(1, 2)[:, :max_len]


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [B, Lq, Hq, D] at absolute positions q_pos [B, Lq]; k/v [B, Lk, Hkv, D]. Returns [B, Lq, Hq, D]
    in fp32. Rows past a request's queries are padding: the callers drop them."""
    key_pos = torch.arange(k.shape[1], device=q.device)[None, None, :]
    allowed = (key_pos <= q_pos[:, :, None]) & (key_pos < seq_lens[:, None, None])
    if sliding_window is not None:
        allowed &= key_pos > q_pos[:, :, None] - sliding_window
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float().transpose(1, 2),
                                         v.float().transpose(1, 2), attn_mask=allowed[:, None],
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None = None, max_seq_len: int | None = None, *,
                     k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [Bd, Hq, D], one query per request at position seq_len - 1."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    k = gather_pages(k_cache, block_tables, max_len, k_scale)
    v = gather_pages(v_cache, block_tables, max_len, v_scale)
    q_pos = (seq_lens.long() - 1)[:, None]
    out = _masked_attention(q[:, None], k, v, q_pos, seq_lens.long(), scale, sliding_window)
    return out[:, 0].to(q.dtype)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor,
                      max_q_len: int, max_seq_len: int, scale: float,
                      sliding_window: int | None = None, *, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [Tp, Hq, D]: chunk i holds rows cu_q_lens[i]:cu_q_lens[i+1], at positions ending at seq_len-1."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    bp = seq_lens.shape[0]
    q_lens = (cu_q_lens[1:] - cu_q_lens[:-1]).long()
    # Scatter the flat rows into a padded [Bp, max_q_len] grid.
    row = torch.arange(q.shape[0], device=q.device)
    seq_of_row = torch.repeat_interleave(torch.arange(bp, device=q.device), q_lens)
    idx_in_seq = row - cu_q_lens[:-1].long()[seq_of_row]
    padded = q.new_zeros(bp, max_q_len, *q.shape[1:])
    padded[seq_of_row, idx_in_seq] = q
    k = gather_pages(k_cache, block_tables, max_seq_len, k_scale)
    v = gather_pages(v_cache, block_tables, max_seq_len, v_scale)
    first_pos = seq_lens.long() - q_lens
    q_pos = first_pos[:, None] + torch.arange(max_q_len, device=q.device)[None, :]
    out = _masked_attention(padded, k, v, q_pos, seq_lens.long(), scale, sliding_window)
    return out[seq_of_row, idx_in_seq].to(q.dtype)
