"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, and the mixtures of experts Mixtral, Qwen2-MoE and
Qwen3-MoE, whose sparse layers take moe.MoE for the MLP) over a flat token batch and a paged KV cache.

q/k/v and gate/up are fused into one matmul each (the loader fills the slices); every hot op goes
through the model's `Backend` (pipeserve/engine/backend), chosen once when the model is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeserve.engine.backend import Backend, NormOut
from pipeserve.engine.kv.metadata import AttentionMetadata
from pipeserve.engine.kv.pool import LayerCache
from pipeserve.engine.quantization.kv_cache import key_means
from pipeserve.model_config import ModelConfig

from .moe import MoE
from .rope import rope_cache


@dataclass(frozen=True)
class NativeSupport:
    """What the native CPU step (pipeserve/engine/executor/native.py over backend/csrc/decode_step.cpp)
    mirrors of this model: each ModelConfig field this module reads is either mirrored or refused
    (tests/test_native_step.py fails on a field read here and declared in neither)."""

    mirrors: frozenset[str]
    refuses: Mapping[str, str]  # field -> why a model that sets it (true, non-zero, any()) runs elsewhere

    def refusal(self, cfg: ModelConfig) -> str | None:
        """Why the native step does not mirror this configuration; None when it does."""
        for name, reason in self.refuses.items():
            value = getattr(cfg, name)
            if any(value) if isinstance(value, list) else value:
                return reason
        return None


NATIVE_STEP = NativeSupport(
    mirrors=frozenset({
        "attention_bias", "head_dim", "hidden_size", "intermediate_size", "kv_size", "layer_sliding_windows",
        "num_heads", "num_kv_heads", "num_layers", "q_size", "rms_norm_eps", "rope_scaling", "rope_theta",
        "tie_word_embeddings", "vocab_size",
    }),
    refuses={
        "moe_layers": "a mixture of experts",
        "shared_expert_intermediate_size": "a mixture of experts (shared expert)",
        "qk_norm": "q/k norms are not in the native step",
    },
)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, backend: Backend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> NormOut:
        return self.backend.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding_window: int | None, backend: Backend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = sliding_window
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        # Qwen3: each head of q and k RMS-normalized before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend) if cfg.qk_norm else None
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output of every row, or with `rows` (the last layer: meta.sample_rows) of those
        alone, each its sequence's newest token: after every row's K/V is written, that is decoding."""
        t = positions.shape[0]  # x may be a quantized activation (QuantAct)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).reshape(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).reshape(t, self.num_kv_heads, self.head_dim)
        # Quantized caches store keys less their sequence's mean (softmax(q.k) is unchanged by it).
        m = None
        if cache.k_means is not None and cache.seq_of_page is not None:
            m = key_means(k, cache.k_means, cache.seq_of_page, meta, cos_sin)
        self.backend.apply_rope(q, k, positions, cos_sin)
        if m is not None:
            k = k - m.to(k.dtype)
        scales = cache.scale_kwargs()
        self.backend.store_kv(k, v, cache.k, cache.v, meta.slot_mapping, **scales)
        if rows is not None:
            assert meta.sample_block_tables is not None and meta.sample_seq_lens is not None
            out = self.backend.decode_attention(
                q.index_select(0, rows),
                cache.k,
                cache.v,
                meta.sample_block_tables,
                meta.sample_seq_lens,
                self.scale,
                self.sliding_window,
                meta.sample_max_seq_len or None,
                **scales,
            )
            projected: torch.Tensor = self.o_proj(out.reshape(-1, self.q_size))
            return projected
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            out[:nd] = self.backend.decode_attention(
                q[:nd],
                cache.k,
                cache.v,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                self.scale,
                self.sliding_window,
                meta.decode_max_seq_len or None,
                **scales,
            )
        if t > nd:
            out[nd:] = self.backend.prefill_attention(
                q[nd:],
                cache.k,
                cache.v,
                meta.prefill_block_tables,
                meta.prefill_cu_q_lens,
                meta.prefill_seq_lens,
                meta.prefill_max_q_len,
                meta.prefill_max_seq_len,
                self.scale,
                self.sliding_window,
                **scales,
                new_kv=(k[nd:], v[nd:]),
            )
        projected = self.o_proj(out.reshape(t, self.q_size))
        return projected


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        # W8A8 quantization swaps in SiLU-and-mul fused with the down projection's input quantization.
        self.act_fn: Callable[[torch.Tensor], Any] = backend.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act_fn(self.gate_up_proj(x)))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: Backend) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, cfg.layer_sliding_windows[layer], backend)
        self.mlp: MLP | MoE
        if cfg.moe_layers and cfg.moe_layers[layer]:
            shared = cfg.shared_expert_intermediate_size
            self.mlp = MoE(cfg, backend, MLP(cfg, backend, shared) if shared else None)
        else:
            self.mlp = MLP(cfg, backend)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.last = layer == cfg.num_layers - 1

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        rows = meta.sample_rows if self.last else None
        x = self.self_attn(x, positions, cos_sin, meta, cache, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend  # quantize_model builds the quantized layers on the same one
        # The loader builds the model on the meta device and fills it: no random init (nn.Embedding's
        # own would import torch._dynamo, seconds of every engine start).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)  # set by init_rope

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        cfg = self.config
        self.cos_sin = rope_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        caches: list[LayerCache],
    ) -> torch.Tensor:
        """Hidden states after the final norm: [T, hidden] for every token of the flat batch, or with
        meta.sample_rows [R, hidden] for those rows. Then the last layer keeps only them after
        writing its K/V: no other row's output is ever read, and that layer's attention, o_proj and
        MLP are most of a prefill row's share of it."""
        x: torch.Tensor = self.embed_tokens(input_ids)
        residual = None
        for layer, cache in zip(self.layers, caches, strict=True):
            x, residual = layer(x, residual, positions, self.cos_sin, meta, cache)
        x, _ = self.norm(x, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Through the head module when there is one: on the CPU it may be a packed CpuLinear.
        logits = (torch.nn.functional.linear(hidden, self.embed_tokens.weight) if self.lm_head is None
                  else self.lm_head(hidden))
        return logits.float()
