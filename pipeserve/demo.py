"""The built-in demo model: a small Llama with deterministic RANDOM weights and a byte-level
tokenizer, written once into a cache dir as an ordinary HF checkpoint so every process (and
every code path, loader included) treats it like a real model. Its output is gibberish."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save_file

from pipeserve.config import cache_dir
from pipeserve.model_config import ModelConfig

log = logging.getLogger(__name__)

DEMO_NAME = "pipeserve-demo-llama-v1"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def default_cache_dir() -> str:
    return os.path.join(cache_dir(), DEMO_NAME)


def random_llama_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """HF-named random weights for a Llama-family config (std 0.02, norms 1): reproducible from the
    seed. A mixture of experts (Mixtral, Qwen2/3-MoE) gets its router, its experts in the fused 3-D
    layout, Qwen2-MoE's shared expert and Qwen3's q/k norms."""
    gen = torch.Generator().manual_seed(seed)
    cfg = ModelConfig.from_dict(config)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    weights = {"model.embed_tokens.weight": rand(config["vocab_size"], hidden),
               "model.norm.weight": torch.ones(hidden)}
    if not config.get("tie_word_embeddings", False):
        weights["lm_head.weight"] = rand(config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(q, hidden),
            p + "self_attn.k_proj.weight": rand(kv, hidden),
            p + "self_attn.v_proj.weight": rand(kv, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, q),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
        if cfg.qk_norm:
            weights |= {p + "self_attn.q_norm.weight": torch.ones(head_dim),
                        p + "self_attn.k_norm.weight": torch.ones(head_dim)}
        mlps = {"mlp": inter}
        if cfg.moe_layers and cfg.moe_layers[i]:
            experts, moe_inter = cfg.num_experts, cfg.moe_intermediate_size
            weights |= {p + "mlp.gate.weight": rand(experts, hidden),
                        p + "mlp.experts.gate_up_proj": rand(experts, 2 * moe_inter, hidden),
                        p + "mlp.experts.down_proj": rand(experts, hidden, moe_inter)}
            mlps = {}
            if cfg.shared_expert_intermediate_size:
                mlps = {"mlp.shared_expert": cfg.shared_expert_intermediate_size}
                weights[p + "mlp.shared_expert_gate.weight"] = rand(1, hidden)
        for name, size in mlps.items():
            weights |= {p + f"{name}.gate_proj.weight": rand(size, hidden),
                        p + f"{name}.up_proj.weight": rand(size, hidden),
                        p + f"{name}.down_proj.weight": rand(hidden, size)}
    return weights


def save_byte_tokenizer(directory: str, max_length: int) -> None:
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab |= {ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        model_max_length=max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def ensure_demo_model(cache_dir: str | None = None) -> str:
    """Build the demo checkpoint once (atomically: concurrent starters are safe) and return its dir."""
    target = cache_dir or default_cache_dir()
    if not os.path.isfile(os.path.join(target, "model.safetensors")):
        log.warning("no --model given: building the DEMO model (RANDOM weights, gibberish output) in %s",
                    target)
    context = DEMO_CONFIG["max_position_embeddings"]
    assert isinstance(context, int)
    return save_random_checkpoint(target, DEMO_CONFIG, seed=0, dtype=torch.float32,
                                  tokenizer=lambda d: save_byte_tokenizer(d, context))


def save_random_checkpoint(target: str, config: dict[str, Any], seed: int = 0,
                           dtype: torch.dtype = torch.bfloat16,
                           tokenizer: Callable[[str], None] | None = None) -> str:
    """A random-weight checkpoint (config.json, generation_config.json, model.safetensors, and a
    tokenizer when `tokenizer` writes one) for a Llama-family config dict (mixtures of experts
    included), built once and atomically. Benchmarks use it for model shapes nobody should download.
    q/k/v biases (Qwen2, Qwen2-MoE) are zero."""
    if os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".random-", dir=os.path.dirname(target) or ".")
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}, f)
        raw = random_llama_weights(config, seed)
        weights = {name: raw.pop(name).to(dtype) for name in list(raw)}  # frees float32 as it goes
        if ModelConfig.from_dict(config).attention_bias:  # Qwen2, Qwen2-MoE
            head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
            kv = config["num_key_value_heads"] * head_dim
            sizes = {"q": config["num_attention_heads"] * head_dim, "k": kv, "v": kv}
            for i in range(config["num_hidden_layers"]):
                weights |= {f"model.layers.{i}.self_attn.{p}_proj.bias": torch.zeros(n, dtype=dtype)
                            for p, n in sizes.items()}
        save_file(weights, os.path.join(tmp, "model.safetensors"))
        del weights
        if tokenizer is not None:
            tokenizer(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
