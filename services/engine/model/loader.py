"""Load a Hugging Face checkpoint directory (config.json + single or sharded safetensors) into our
model, fusing q/k/v and gate/up on the fly. Every parameter must be filled exactly once."""

from __future__ import annotations

import json
import logging
import os
import re

import torch
from safetensors import safe_open

from services.engine.backend import Backend
from services.model_config import ModelConfig

from .llama import LlamaForCausalLM

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


def _target(cfg: ModelConfig, name: str) -> tuple[str, int, int] | None:
    """HF tensor name -> (our parameter name, first row, last row) or None to skip."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", 0, cfg.vocab_size
    if name == "model.norm.weight":
        return "norm.weight", 0, cfg.hidden_size
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else ("lm_head.weight", 0, cfg.vocab_size)
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    layer, rest = m.group(1), m.group(2)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, q + kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
    }
    module, _, kind = rest.rpartition(".")
    if module in fused:
        ours, lo, hi = fused[module]
        return f"layers.{layer}.{ours}.{kind}", lo, hi
    return f"layers.{layer}.{rest}", 0, -1


def load_model(
    model_dir: str, backend: Backend, device: torch.device, dtype: torch.dtype, max_positions: int
) -> tuple[LlamaForCausalLM, ModelConfig]:
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend)
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
                ours, lo, hi = target
                if ours not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
                param = params[ours]
                hi = param.shape[0] if hi == -1 else hi
                tensor = f.get_tensor(name)
                expected = (hi - lo, *param.shape[1:])
                if tuple(tensor.shape) != expected:
                    raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
                with torch.no_grad():
                    param[lo:hi].copy_(tensor)
                filled[ours] += hi - lo
    missing = [n for n, rows in filled.items() if rows != params[n].shape[0]]
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
