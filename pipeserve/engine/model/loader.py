"""Load a Hugging Face checkpoint directory (config.json + single or sharded safetensors) into our
model, fusing q/k/v and gate/up on the fly. Mixture-of-experts checkpoints come in two layouts,
both read here: one module per expert (`experts.N.w1` / `experts.N.gate_proj`, what transformers
saves) and fused 3-D expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]). Every parameter must be filled exactly once."""

from __future__ import annotations

import json
import logging
import os
import re

import torch
from safetensors import safe_open

from pipeserve.engine.backend import Backend
from pipeserve.engine.parallel.group import TPGroup
from pipeserve.model_config import ModelConfig

from .llama import LlamaForCausalLM
from .tensor_parallel import ShardPlan, TensorParallelLlama

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def resolve_dtype(dtype: str, device: torch.device, config: ModelConfig) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}")
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    checkpoint = DTYPES.get(config.torch_dtype, torch.bfloat16)
    return torch.bfloat16 if checkpoint == torch.float32 else checkpoint


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return [os.path.join(model_dir, n) for n in names]


Index = tuple[int | slice, ...]
ALL: Index = ()
# A per-expert tensor: Mixtral's experts.N.w1 / w3 / w2, Qwen-MoE's experts.N.gate_proj / up_proj / down_proj.
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# The fused layout: all experts' [gate | up] as one [E, 2I, H] tensor, their down_proj as [E, H, I].
_FUSED_EXPERTS = {"mlp.experts.gate_up_proj": "mlp.experts.w13", "mlp.experts.down_proj": "mlp.experts.w2"}


def _target(cfg: ModelConfig, name: str) -> tuple[str, Index] | None:
    """HF tensor name -> (our parameter name, the part of it the tensor fills) or None to skip."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", ALL
    if name == "model.norm.weight":
        return "norm.weight", ALL
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else ("lm_head.weight", ALL)
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    layer, rest = m.group(1), m.group(2).replace("block_sparse_moe.", "mlp.")  # Mixtral's name
    if rest in _FUSED_EXPERTS:
        return f"layers.{layer}.{_FUSED_EXPERTS[rest]}", ALL
    expert = _EXPERT.match(rest)
    if expert is not None:
        e, proj = int(expert.group(1)), expert.group(2)
        inter = cfg.moe_intermediate_size
        if proj in ("w2", "down_proj"):
            return f"layers.{layer}.mlp.experts.w2", (e,)
        up = proj in ("w3", "up_proj")
        return f"layers.{layer}.mlp.experts.w13", (e, slice(inter if up else 0, 2 * inter if up else inter))
    q, kv = cfg.q_size, cfg.kv_size
    qkv = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    module, _, kind = rest.rpartition(".")
    parent, _, proj = module.rpartition(".")
    if parent == "self_attn" and proj in qkv:
        lo, hi = qkv[proj]
        return f"layers.{layer}.self_attn.qkv_proj.{kind}", (slice(lo, hi),)
    if parent in ("mlp", "mlp.shared_expert") and proj in ("gate_proj", "up_proj"):
        shared = parent == "mlp.shared_expert"
        inter = cfg.shared_expert_intermediate_size if shared else cfg.intermediate_size
        lo = inter if proj == "up_proj" else 0
        return f"layers.{layer}.{parent}.gate_up_proj.{kind}", (slice(lo, lo + inter),)
    return f"layers.{layer}.{rest}", ALL


def load_model(
    model_dir: str, backend: Backend, device: torch.device, dtype: torch.dtype, max_positions: int,
    tp: TPGroup | None = None, rope_scaling: str | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model and the checkpoint's config (rope_scaling: the --rope-scaling override); with `tp`,
    this rank's shard (its `config` is then the shard's, pipeserve/engine/model/tensor_parallel.py)."""
    cfg = ModelConfig.from_dir(model_dir, rope_scaling)
    shard = None if tp is None else ShardPlan(cfg, tp.rank, tp.world)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend) if tp is None else TensorParallelLlama(cfg, backend, tp)
    model = model.to_empty(device=device).to(dtype)
    model.init_rope(max_positions, device)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if _IGNORED.search(name):
                    continue
                target = _target(cfg, name)
                if target is None:
                    continue
                ours, index = target
                if ours not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
                tensor = f.get_tensor(name)
                if shard is not None:
                    index, tensor = shard.piece(ours, index, tensor)
                part = params[ours][index]
                if tensor.shape != part.shape:
                    raise ValueError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(part.shape)}"
                    )
                with torch.no_grad():
                    part.copy_(tensor)
                filled[ours] += tensor.numel()
    missing = [n for n, count in filled.items() if count != params[n].numel()]
    if missing:
        raise ValueError(
            f"checkpoint {model_dir} lacks tensors for: {', '.join(missing[:8])}"
            + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        )
    model.eval().requires_grad_(False)
    log.info(
        "loaded %s (%s, %d layers) on %s as %s", cfg.name, cfg.architecture, cfg.num_layers, device, dtype
    )
    return model, cfg
