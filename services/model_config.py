"""The one reader of a checkpoint's config.json (and generation_config.json). Torch-free: the engine,
its loader and the tokenizer workers all read a checkpoint through here, so they cannot disagree on
its context length or vocabulary."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Keys that state the trained context length, in the order transformers' configs prefer them.
CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
# transformers' LlamaConfig default, so a config without any of the keys loads as transformers reads it.
DEFAULT_CONTEXT_LENGTH = 2048


def read_config(model_dir: str) -> dict[str, Any]:
    """config.json as a dict, a multimodal wrapper's `text_config` merged over it (the language model's
    fields win; the wrapper's `architectures` stays when the inner config has none)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face checkpoint: no config.json")
    with open(path) as f:
        cfg: dict[str, Any] = json.load(f)
    return unwrap_text_config(cfg)


def unwrap_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    text = cfg.get("text_config")
    return cfg | text if isinstance(text, dict) else cfg


def context_length(cfg: dict[str, Any]) -> int:
    """The trained context length: the first integer among CONTEXT_LENGTH_KEYS, else the default."""
    return next(
        (cfg[k] for k in CONTEXT_LENGTH_KEYS if isinstance(cfg.get(k), int) and not isinstance(cfg[k], bool)),
        DEFAULT_CONTEXT_LENGTH,
    )


# generation_config.json keys that are sampling defaults -> the SamplingParams field each sets (those
# vLLM applies; max_new_tokens is left out: a request's max_tokens must fit the context it leaves).
GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def read_generation_config(model_dir: str) -> dict[str, Any]:
    """generation_config.json as a dict; {} when the checkpoint has none."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


def generation_eos(model_dir: str) -> list[int] | None:
    """generation_config.json's eos ids (often several, e.g. chat end markers), if it states any."""
    eos = read_generation_config(model_dir).get("eos_token_id")
    return _ids(eos) if eos is not None else None


def generation_defaults(model_dir: str) -> dict[str, int | float]:
    """The sampling defaults the checkpoint's generation_config.json states, by SamplingParams field:
    they apply to requests that leave those fields unset."""
    data = read_generation_config(model_dir)
    return {
        name: data[key]
        for key, name in GENERATION_DEFAULTS.items()
        if isinstance(data.get(key), (int, float)) and not isinstance(data[key], bool)
    }


def _ids(value: Any) -> list[int]:
    return [value] if isinstance(value, int) else [int(v) for v in value]


@dataclass
class ModelLimits:
    """What the tokenizer checks prompts against, without the architecture checks of ModelConfig."""

    context_len: int  # positions the model was trained for
    vocab_size: int  # rows of the embedding: larger ids would index out of range


def model_limits(model_dir: str) -> ModelLimits:
    cfg = read_config(model_dir)
    return ModelLimits(context_len=context_length(cfg), vocab_size=int(cfg["vocab_size"]))


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    layer_sliding_windows: list[int | None]  # per layer: None = full attention
    torch_dtype: str
    eos_token_ids: list[int]
    bos_token_id: int | None
    name: str = ""

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        cfg = unwrap_text_config(cfg)
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        layers = cfg["num_hidden_layers"]
        rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5 keeps theta in here
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        window = cfg.get("sliding_window")
        windows: list[int | None]
        if "layer_types" in cfg:
            windows = [window if t == "sliding_attention" else None for t in cfg["layer_types"]]
        elif arch == "Qwen2ForCausalLM":
            use = cfg.get("use_sliding_window", False) and window
            first = cfg.get("max_window_layers", layers)
            windows = [window if use and i >= first else None for i in range(layers)]
        else:
            windows = [window] * layers
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=context_length(cfg),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            layer_sliding_windows=windows,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            eos_token_ids=[] if eos is None else _ids(eos),
            bos_token_id=cfg.get("bos_token_id"),
            name=name,
        )

    @classmethod
    def from_dir(cls, model_dir: str) -> ModelConfig:
        config = cls.from_dict(read_config(model_dir), name=os.path.basename(os.path.normpath(model_dir)))
        eos = generation_eos(model_dir)  # the ids generation should stop on win over config.json's
        if eos is not None:
            config.eos_token_ids = eos
        return config

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
