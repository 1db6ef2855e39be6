"""A model's tokenizer and the limits the tokenizer checks prompts against, without importing torch
(`from transformers import AutoTokenizer` pulls torch in; PreTrainedTokenizerFast does not)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast


def resolve_model_dir(model: str | None) -> str:
    """The checkpoint dir; None means the built-in demo model (building it imports torch, once)."""
    if model:
        return model
    from services.engine.model.demo import ensure_demo_model

    return ensure_demo_model()


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerFast:
    """The fast (Rust) tokenizer of a checkpoint dir: tokenizer.json plus tokenizer_config.json
    (special tokens, chat template)."""
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json: pipeserve needs a fast tokenizer")
    return PreTrainedTokenizerFast.from_pretrained(model_dir)


@dataclass
class ModelLimits:
    context_len: int  # positions the model was trained for
    vocab_size: int  # rows of the embedding: larger ids would index out of range


def model_limits(model_dir: str) -> ModelLimits:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)  # multimodal wrappers keep the language model's config inside
    context = next((cfg[k] for k in ("max_position_embeddings", "max_sequence_length", "seq_length",
                                     "n_positions") if isinstance(cfg.get(k), int)), None)
    if context is None:
        raise ValueError(f"{model_dir}/config.json states no context length (max_position_embeddings)")
    return ModelLimits(context_len=context, vocab_size=int(cfg["vocab_size"]))
