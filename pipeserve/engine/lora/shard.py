"""A tensor-parallel rank's part of an adapter, cut the way its base layers are (the model's
ShardPlan), so that each rank's LoRA layers apply their factors to the base layer's own shard:
- column-parallel qkv and gate_up: A is replicated; B keeps the output columns of the rank's base
  rows, sub-projection by sub-projection (its query heads, its KV heads, its gate and up slices).
  The rank's delta is the exact delta of its output columns.
- row-parallel o and down: A keeps the input features of the rank's base input columns (rows of
  A^T); B is replicated. Each rank's delta (x_r A_r^T) B is a partial sum, added to the base
  layer's partial sum before the block's all-reduce: the sum over ranks is (x A^T) B, once."""

from __future__ import annotations

import torch

from pipeserve.engine.model.tensor_parallel import ShardPlan
from pipeserve.model_config import ModelConfig

from .layout import DOWN, MODEL_ATTR, OUT, FusedShape, fused_shapes


class LoRAShard:
    def __init__(self, cfg: ModelConfig, rank: int, world: int) -> None:
        self.plan = ShardPlan(cfg, rank, world)
        self.local = self.plan.local  # the config the rank's layers (and its slot table) are shaped by
        self.full: dict[str, FusedShape] = fused_shapes(cfg)  # the adapters' (unsharded) layout

    def copy(self, layer: int, kind: str, dst: tuple[torch.Tensor, torch.Tensor],
             src: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The full factors src (A^T [in, n R], B [n R, out]) -> this rank's, written into dst."""
        (dst_a, dst_b), (a, b) = dst, src
        block, attr = MODEL_ATTR[kind]
        name = f"layers.{layer}.{block}.{attr}.weight"  # the base weight whose split the factors follow
        if kind in (OUT, DOWN):
            # A [n R, in] splits along `in` as the weight [out, in] does.
            _, part = self.plan.piece(name, (), a.t())
            dst_a.copy_(part.t())
            dst_b.copy_(b)
            return
        dst_a.copy_(a)
        for _, offset, size in self.full[kind].subs:
            # B^T's rows of one sub-projection are placed like the weight's rows of it.
            sub = b[:, offset : offset + size].t()
            index, part = self.plan.piece(name, (slice(offset, offset + size),), sub)
            dst_b[:, index[0]] = part.t()
