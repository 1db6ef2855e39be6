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


def build_tiny_model(path: str, kind: str = "llama", seed: int = 0, **overrides) -> str:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from services.engine.model.demo import save_byte_tokenizer

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    torch.manual_seed(seed)
    config = config_cls(**(BASE | overrides))
    model = model_cls(config).float().eval()
    with torch.no_grad():  # random init is tiny; widen it so greedy tokens are not all ties
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)  # Qwen2's q/k/v biases: make them matter
    model.save_pretrained(path)
    save_byte_tokenizer(path, config.max_position_embeddings)
    return path
