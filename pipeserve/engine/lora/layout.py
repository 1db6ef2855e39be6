"""How PEFT's projections map onto the model's fused linear layers: q/k/v share `qkv_proj`, gate/up
share `gate_up_proj`. A fused layer's adapter factors stack the sub-projections' ranks: A [n * R, in]
(held transposed) and B [n * R, out], B block-diagonal over the sub-projections' output slices
(R: max_lora_rank)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeserve.model_config import ModelConfig

QKV, OUT, GATE_UP, DOWN = "qkv", "o", "gate_up", "down"
KINDS = (QKV, OUT, GATE_UP, DOWN)
SUBS: dict[str, tuple[str, ...]] = {
    QKV: ("q_proj", "k_proj", "v_proj"),
    OUT: ("o_proj",),
    GATE_UP: ("gate_proj", "up_proj"),
    DOWN: ("down_proj",),
}
KIND_OF = {module: kind for kind, modules in SUBS.items() for module in modules}
MODEL_ATTR = {QKV: ("self_attn", "qkv_proj"), OUT: ("self_attn", "o_proj"),
              GATE_UP: ("mlp", "gate_up_proj"), DOWN: ("mlp", "down_proj")}


@dataclass(frozen=True)
class FusedShape:
    d_in: int
    d_out: int
    subs: tuple[tuple[str, int, int], ...]  # (module, output offset, output size)


def projection_sizes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module -> (in, out) features."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, cfg.q_size), "k_proj": (h, cfg.kv_size), "v_proj": (h, cfg.kv_size),
            "o_proj": (cfg.q_size, h), "gate_proj": (h, inter), "up_proj": (h, inter),
            "down_proj": (inter, h)}


def fused_shapes(cfg: ModelConfig) -> dict[str, FusedShape]:
    sizes = projection_sizes(cfg)
    shapes = {}
    for kind, modules in SUBS.items():
        offset, subs = 0, []
        for m in modules:
            subs.append((m, offset, sizes[m][1]))
            offset += sizes[m][1]
        shapes[kind] = FusedShape(sizes[modules[0]][0], offset, tuple(subs))
    return shapes


def dense_mlp_layers(cfg: ModelConfig) -> list[bool]:
    """Per layer: whether its MLP is the dense one an adapter may target (not a mixture of experts)."""
    moe = cfg.moe_layers or [False] * cfg.num_layers
    return [not m for m in moe]
