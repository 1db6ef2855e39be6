"""A model's tokenizer, without importing torch (`from transformers import AutoTokenizer` pulls torch
in; PreTrainedTokenizerFast does not). The limits prompts are checked against come from the one
config reader, services.model_config, which the engine uses too."""

from __future__ import annotations

import os

from transformers import PreTrainedTokenizerFast

from services.model_config import ModelLimits, model_limits

__all__ = ["ModelLimits", "load_tokenizer", "model_limits", "resolve_model_dir"]


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
    tokenizer: PreTrainedTokenizerFast = PreTrainedTokenizerFast.from_pretrained(model_dir)
    return tokenizer
