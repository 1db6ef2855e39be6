"""Models for gpu-check (and the tests): tiny random Hugging Face checkpoints of the supported families
built in-process with transformers (nothing downloaded), and full-size shapes (Llama-3.2-1B,
Llama-3-8B) whose weights are drawn at random directly on the device, no checkpoint written."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

BASE: dict[str, Any] = dict(
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
MOE: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96),
    # Layer 0 dense (mlp_only_layers), layer 1 sparse with a shared expert, top-k weights not renormalized.
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=64,
                      shared_expert_intermediate_size=96, mlp_only_layers=[0], norm_topk_prob=False),
    # decoder_sparse_step 2: layer 0 dense, layer 1 sparse; q/k norms; renormalized top-k.
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=2,
                      norm_topk_prob=True),
}

# Full-size shapes for the speed rows (config.json fields of the real checkpoints).
SHAPES: dict[str, dict[str, Any]] = {
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                    rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                    rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5),
}


def build_tiny_model(path: str, kind: str = "llama", seed: int = 0, **overrides: Any) -> str:
    """A tiny random checkpoint of `kind` (llama, qwen2, mistral, mixtral, qwen2_moe, qwen3_moe) in
    `path`: safetensors in fp32, config.json and a byte-level tokenizer. Weights wider than the default
    init, so greedy tokens are not decided by ties."""
    import transformers

    from pipeserve.demo import save_byte_tokenizer

    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    }
    config_name, model_name = classes[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**(BASE | MOE.get(kind, {}) | overrides))
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
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


def write_shape_config(path: str, shape: str, torch_dtype: str = "bfloat16") -> str:
    """A checkpoint directory with only config.json (a Llama of SHAPES[shape]) and a tokenizer."""
    from pipeserve.demo import save_byte_tokenizer

    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1,
           "eos_token_id": 2, "torch_dtype": torch_dtype, **SHAPES[shape]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_byte_tokenizer(path, 4096)
    return path
