"""The Llama-family model sharded across the ranks of a tensor-parallel group (Megatron-style).

Each rank builds the ordinary LlamaForCausalLM from its *local* config (`local_config`: its query
heads, its KV heads, its slice of the intermediate and vocabulary dimensions), so every layer,
backend op, quantization method and the KV pool run unchanged on the shard. What tensor
parallelism adds is where each rank's slice comes from (`ShardPlan`, used by the loader) and three
collectives:
- column-parallel qkv_proj and gate_up_proj (and the experts' w13): each rank holds the output rows
  of its heads / of its intermediate slice; no communication.
- row-parallel o_proj and down_proj (and the experts' w2): each rank holds the matching input
  columns and produces a partial sum; one all-reduce per attention block and per MLP / MoE block
  (a forward hook on the block, so quantization may swap the projections inside it).
- vocab-parallel embedding (a masked lookup of the rank's rows, then an all-reduce) and LM head
  (each rank's logits for its rows, gathered on rank 0, which samples).
Attention heads are split by rank; when there are fewer KV heads than ranks, each rank keeps the
one KV head its query heads read (so the KV heads are replicated across the ranks sharing them).
The router of a mixture of experts is replicated; every expert is split along its intermediate dim.
The forward pass itself is the ordinary one: rank 0's runner sends the other ranks the step plan
(pipeserve/engine/parallel/step_plan.py) before it runs it, and each rank runs it on its shard.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeserve.engine.backend import Backend
from pipeserve.engine.parallel.group import TPGroup
from pipeserve.model_config import ModelConfig

from .llama import DecoderLayer, LlamaForCausalLM

Index = tuple[Any, ...]


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """ValueError naming the dimension that does not split over `world` ranks."""
    problems = []
    if cfg.num_heads % world:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % world and world % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (neither a multiple nor a divisor of the ranks)")
    dense = not cfg.moe_layers or not all(cfg.moe_layers)
    for name, size in (("intermediate size", cfg.intermediate_size if dense else 0),
                       ("expert intermediate size", cfg.moe_intermediate_size),
                       ("shared expert intermediate size", cfg.shared_expert_intermediate_size)):
        if size % world:
            problems.append(f"{name} {size}")
    if problems:
        raise ValueError(f"tensor_parallel_size {world} does not divide the model's {', '.join(problems)}")


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config a rank's shard is built from (every rank's has the same shapes)."""
    return replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=max(1, cfg.num_kv_heads // world),
        intermediate_size=cfg.intermediate_size // world,
        moe_intermediate_size=cfg.moe_intermediate_size // world,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // world,
        vocab_size=-(-cfg.vocab_size // world),  # the last rank's rows past the vocabulary stay zero
    )


class ShardPlan:
    """Which part of each full checkpoint tensor rank `rank` keeps, and where in its parameter."""

    def __init__(self, cfg: ModelConfig, rank: int, world: int) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.local = local_config(cfg, world)
        # The first KV head this rank keeps: its own block, or the one its query heads share.
        self.kv_start = (rank * self.local.num_kv_heads if cfg.num_kv_heads >= world
                         else rank * cfg.num_kv_heads // world)

    def _rows(self, tensor: torch.Tensor, size: int, dim: int, start: int | None = None) -> torch.Tensor:
        """The rank's `size` entries of `tensor` along `dim` (from `start`, by default rank * size)."""
        begin = self.rank * size if start is None else start
        return tensor.narrow(dim, begin, size)

    def piece(self, ours: str, index: Index, tensor: torch.Tensor) -> tuple[Index, torch.Tensor]:
        """(index into our local parameter, the slice of the checkpoint tensor it takes), given the
        loader's target for the full model: parameter `ours`, at `index`."""
        cfg, local = self.cfg, self.local
        if ours.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            lo = index[0].start
            d = cfg.head_dim
            if lo == 0:  # q
                return (slice(0, local.q_size),), self._rows(tensor, local.q_size, 0)
            k = lo == cfg.q_size
            at = local.q_size + (0 if k else local.kv_size)
            part = self._rows(tensor, local.kv_size, 0, self.kv_start * d)
            return (slice(at, at + local.kv_size),), part
        if ours.endswith("gate_up_proj.weight") or ours.endswith("experts.w13"):
            full = cfg.moe_intermediate_size if ours.endswith("experts.w13") else None
            if full is None:
                full = (cfg.shared_expert_intermediate_size if ".shared_expert." in ours
                        else cfg.intermediate_size)
            size = full // self.world
            if not index:  # the fused experts' [E, 2I, H]: gate rows, then up rows
                gate = self._rows(tensor, size, 1)
                up = self._rows(tensor, size, 1, full + self.rank * size)
                return (), torch.cat([gate, up], 1)
            *lead, part = index  # (expert,)? + the gate or up slice of a 2-D [I, H] tensor
            at = size if part.start == full else 0
            return (*lead, slice(at, at + size)), self._rows(tensor, size, 0)
        if ours.endswith("o_proj.weight"):
            return index, self._rows(tensor, local.q_size, 1)
        if ours.endswith("down_proj.weight"):
            full = cfg.shared_expert_intermediate_size if ".shared_expert." in ours else cfg.intermediate_size
            return index, self._rows(tensor, full // self.world, 1)
        if ours.endswith("experts.w2"):
            size = local.moe_intermediate_size
            return index, self._rows(tensor, size, tensor.dim() - 1)
        if ours in ("embed_tokens.weight", "lm_head.weight"):
            size = local.vocab_size
            start = self.rank * size
            rows = tensor[start : start + size]
            return index, F.pad(rows, (0, 0, 0, size - rows.shape[0]))
        return index, tensor  # replicated: norms, the router, the shared expert's gate


class VocabParallelEmbedding(nn.Embedding):
    """The rank's rows of the embedding: a token outside them contributes zeros, and the all-reduce
    sums the one rank's row that holds it."""

    def __init__(self, num_rows: int, hidden: int, group: TPGroup) -> None:
        super().__init__(num_rows, hidden, _weight=torch.empty(num_rows, hidden))  # filled by the loader
        self.start, self.num_rows, self.group = group.rank * num_rows, num_rows, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        self.group.all_reduce(out)
        return out


def _all_reduce_output(group: TPGroup, _module: nn.Module, _inputs: Any,
                       output: torch.Tensor) -> torch.Tensor:
    group.all_reduce(output)
    return output


class TensorParallelLlama(LlamaForCausalLM):
    """One rank's shard. `config` is the local config; `full_config` the checkpoint's."""

    def __init__(self, cfg: ModelConfig, backend: Backend, group: TPGroup) -> None:
        check_shardable(cfg, group.world)
        local = local_config(cfg, group.world)
        super().__init__(local, backend)
        self.full_config, self.group = cfg, group
        self.embed_tokens = VocabParallelEmbedding(local.vocab_size, cfg.hidden_size, group)
        reduce = partial(_all_reduce_output, group)
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.register_forward_hook(reduce)  # o_proj's partial sums
            layer.mlp.register_forward_hook(reduce)  # down_proj's (every expert's, the shared one's)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rank 0: the full [R, vocab] logits; the other ranks: their own columns (unused)."""
        local = super().compute_logits(hidden)
        parts = self.group.gather(local)
        if parts is None:
            return local
        return torch.cat(parts, dim=-1)[:, : self.full_config.vocab_size]
