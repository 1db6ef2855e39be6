"""Tiny random Hugging Face checkpoints for tests (built with transformers, saved as safetensors)."""

from __future__ import annotations

import torch

BASE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=320,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


# Mixtures of experts: overrides of BASE that make them small and exercise their options.
MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96),
    # Layer 0 dense (mlp_only_layers), layer 1 sparse with a shared expert, top-k weights not renormalized.
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=64,
                      shared_expert_intermediate_size=96, mlp_only_layers=[0], norm_topk_prob=False),
    # decoder_sparse_step 2: layer 0 dense, layer 1 sparse; q/k norms; renormalized top-k.
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=2,
                      norm_topk_prob=True),
}


def build_tiny_model(path: str, kind: str = "llama", seed: int = 0, **overrides) -> str:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from pipeserve.engine.model.demo import save_byte_tokenizer

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "mixtral": (MixtralConfig, MixtralForCausalLM),
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    torch.manual_seed(seed)
    config = config_cls(**(BASE | MOE.get(kind, {}) | overrides))
    model = model_cls(config).float().eval()
    with torch.no_grad():  # random init is tiny; widen it so greedy tokens are not all ties
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)  # Qwen2's q/k/v biases: make them matter
            elif kind in MOE and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1, 0.3)  # Qwen3's q/k norms: a swap of the two would show
    model.save_pretrained(path)
    save_byte_tokenizer(path, config.max_position_embeddings)
    return path


def write_fused_experts(src: str, dst: str) -> str:
    """A copy of the MoE checkpoint `src` in the fused expert layout some checkpoints ship: per
    layer, mlp.experts.gate_up_proj [E, 2I, H] (gate rows, then up) and mlp.experts.down_proj [E, H, I]
    instead of one module per expert (Mixtral's block_sparse_moe renamed to mlp, as those do)."""
    import os
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    names = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up",
             "w2": "down", "down_proj": "down"}
    pattern = re.compile(
        r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
    )
    tensors = load_file(os.path.join(src, "model.safetensors"))
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        m = pattern.match(name)
        if m is None:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
            continue
        layer, e, proj = m.group(1), int(m.group(2)), names[m.group(3)]
        experts.setdefault(layer, {}).setdefault(proj, {})[e] = tensor
    assert experts, "no per-expert tensors in the source checkpoint"
    for layer, projs in experts.items():
        stack = {p: torch.stack([projs[p][e] for e in sorted(projs[p])]) for p in ("gate", "up", "down")}
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1).contiguous()
        out[f"{layer}.mlp.experts.down_proj"] = stack["down"].contiguous()
    os.remove(os.path.join(dst, "model.safetensors"))
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst
