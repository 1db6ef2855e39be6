"""The one reader of a checkpoint's config.json (and generation_config.json). Torch-free: the engine,
its loader and the tokenizer workers all read a checkpoint through here, so they cannot disagree on
its context length or vocabulary."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
# A config without `architectures` names its family by model_type, as transformers' auto classes read it.
ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# Mixtures of experts: routed experts in (some) layers, read by moe_fields.
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# Keys that state the trained context length, in the order transformers' configs prefer them.
CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
# transformers' LlamaConfig default, so a config without any of the keys loads as transformers reads it.
DEFAULT_CONTEXT_LENGTH = 2048


def read_config(model_dir: str, rope_scaling: str | None = None) -> dict[str, Any]:
    """config.json as a dict, a multimodal wrapper's `text_config` merged over it (the language model's
    fields win; the wrapper's `architectures` stays when the inner config has none), with the
    rope_scaling override (--rope-scaling, JSON) applied."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face checkpoint: no config.json")
    with open(path) as f:
        cfg: dict[str, Any] = json.load(f)
    cfg = unwrap_text_config(cfg)
    return cfg if rope_scaling is None else with_rope_scaling(cfg, json.loads(rope_scaling))


def with_rope_scaling(cfg: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """cfg with its rope_scaling replaced. Linear scaling stretches the positions the model was
    trained on by its factor, so the context grows with it (as vLLM derives it); llama3's config
    already states the extended context."""
    out = {k: v for k, v in cfg.items() if k != "rope_parameters"} | {"rope_scaling": scaling}
    if "rope_theta" not in cfg and isinstance(cfg.get("rope_parameters"), dict):  # transformers >= 5
        out["rope_theta"] = cfg["rope_parameters"].get("rope_theta", 10000.0)
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        out["max_position_embeddings"] = int(context_length(cfg) * float(scaling["factor"]))
    return out


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


def _attention_bias(arch: str, cfg: dict[str, Any]) -> bool:
    if arch == "Qwen2ForCausalLM":
        return bool(cfg.get("attention_bias", True))
    if arch == "Qwen2MoeForCausalLM":
        return bool(cfg.get("qkv_bias", True))  # always on in checkpoints older than the field
    return bool(cfg.get("attention_bias", False))


def moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelConfig, as transformers reads them: Mixtral routes
    every layer through `num_local_experts` experts of `intermediate_size` and always renormalizes
    its top-k weights; Qwen2/3-MoE make layer i sparse when (i + 1) % decoder_sparse_step == 0 and i
    is not in mlp_only_layers, with experts of `moe_intermediate_size`; Qwen2-MoE adds its shared
    expert."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    layers = cfg["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        return dict(
            num_experts=cfg.get("num_local_experts", 8),
            num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
            moe_intermediate_size=cfg["intermediate_size"],
            norm_topk_prob=True,
            moe_layers=[True] * layers,
        )
    # transformers >= 5 writes Qwen3-MoE's num_experts under its alias num_local_experts.
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return dict(
        num_experts=experts,
        num_experts_per_tok=cfg.get("num_experts_per_tok", 4),
        moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(
            cfg.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0
        ),
        moe_layers=[experts > 0 and (i + 1) % step == 0 and i not in dense for i in range(layers)],
    )


@dataclass
class ModelLimits:
    """What the tokenizer checks prompts against, without the architecture checks of ModelConfig."""

    context_len: int  # positions the model was trained for
    vocab_size: int  # rows of the embedding: larger ids would index out of range


def model_limits(model_dir: str, rope_scaling: str | None = None) -> ModelLimits:
    cfg = read_config(model_dir, rope_scaling)
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
    # Mixture of experts (num_experts == 0: a dense model). Expert weights are [moe_intermediate_size,
    # hidden]; a layer whose moe_layers entry is False keeps the dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert with a sigmoid gate
    moe_layers: list[bool] = field(default_factory=list)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        cfg = unwrap_text_config(cfg)
        archs = cfg.get("architectures") or [ARCHITECTURE_BY_MODEL_TYPE.get(cfg.get("model_type", ""), "")]
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
        elif arch == "Qwen3MoeForCausalLM":
            windows = [window if cfg.get("use_sliding_window", False) else None] * layers
        elif arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
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
            attention_bias=_attention_bias(arch, cfg),
            layer_sliding_windows=windows,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            eos_token_ids=[] if eos is None else _ids(eos),
            bos_token_id=cfg.get("bos_token_id"),
            name=name,
            qk_norm=arch == "Qwen3MoeForCausalLM",
            **moe_fields(arch, cfg),
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_dir(cls, model_dir: str, rope_scaling: str | None = None) -> ModelConfig:
        """The checkpoint's config (rope_scaling: the --rope-scaling override, JSON)."""
        name = os.path.basename(os.path.normpath(model_dir))
        config = cls.from_dict(read_config(model_dir, rope_scaling), name=name)
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
