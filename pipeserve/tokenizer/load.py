"""A model's tokenizer, without importing torch (`from transformers import AutoTokenizer` pulls torch
in; PreTrainedTokenizerFast does not). The limits prompts are checked against come from the one
config reader, pipeserve.model_config, which the engine uses too.

Checkpoints that ship only a slow SentencePiece tokenizer (`tokenizer.model`, no `tokenizer.json`)
are converted to a fast one as transformers does, once: the result is written to the pipeserve
cache (keyed by the tokenizer files' contents), so every worker process loads it as it loads any
fast tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

from transformers import PreTrainedTokenizerFast

from pipeserve import hub
from pipeserve.config import EngineConfig, cache_dir
from pipeserve.model_config import ModelLimits, model_limits

__all__ = ["ModelLimits", "load_for", "load_tokenizer", "model_limits", "read_chat_template",
           "resolve_model_dir"]

# The files a slow tokenizer's conversion reads: the cache key of the converted one.
SLOW_TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                        "added_tokens.json", "chat_template.jinja")


def resolve_model_dir(model: str | None, revision: str | None = None) -> str:
    """The checkpoint dir of a path or hub id; None means the built-in demo model (building it imports
    torch, once)."""
    if model:
        return hub.resolve(model, revision)
    from pipeserve.demo import ensure_demo_model

    return ensure_demo_model()


def fast_tokenizer_dir(model_dir: str) -> str:
    """A directory with the checkpoint's fast tokenizer: its own, or the converted slow one."""
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return model_dir
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.model")):
        raise FileNotFoundError(f"{model_dir} has no tokenizer (neither tokenizer.json nor tokenizer.model): "
                                "give one with --tokenizer")
    digest = hashlib.sha256()
    for name in SLOW_TOKENIZER_FILES:
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    target = os.path.join(cache_dir(), "tokenizers", digest.hexdigest()[:24])
    if not os.path.isfile(os.path.join(target, "tokenizer.json")):
        converted = slow_tokenizer_class(model_dir).from_pretrained(model_dir)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(target))
        converted.save_pretrained(staging)
        try:
            os.rename(staging, target)  # atomic: concurrent workers never see half a tokenizer
        except OSError:  # another process got there first
            shutil.rmtree(staging, ignore_errors=True)
    return target


def slow_tokenizer_class(model_dir: str) -> type[PreTrainedTokenizerFast]:
    """The transformers class that converts this checkpoint's SentencePiece model to a fast tokenizer:
    the one tokenizer_config.json names when transformers has a converter for it, else Llama's (the
    SentencePiece layout of every architecture pipeserve serves). transformers' generic class would
    read the model without the Llama normalizer and split words differently."""
    import transformers
    from transformers.convert_slow_tokenizer import SLOW_TO_FAST_CONVERTERS

    path = os.path.join(model_dir, "tokenizer_config.json")
    named = ""
    if os.path.isfile(path):
        with open(path) as f:
            named = str(json.load(f).get("tokenizer_class") or "").removesuffix("Fast")
    cls: type[PreTrainedTokenizerFast] = (
        getattr(transformers, named) if named in SLOW_TO_FAST_CONVERTERS else transformers.LlamaTokenizer
    )
    return cls


def read_chat_template(value: str) -> str:
    """--chat-template: a file's contents, or the Jinja template given inline."""
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" not in value:
        raise FileNotFoundError(f"--chat-template {value}: no such file, and not a Jinja template")
    return value


def load_tokenizer(model_dir: str, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """The fast (Rust) tokenizer of a checkpoint dir, with its special tokens and chat template
    (chat_template, a file or the template itself, replaces the checkpoint's)."""
    source = fast_tokenizer_dir(model_dir)
    tokenizer: PreTrainedTokenizerFast = PreTrainedTokenizerFast.from_pretrained(source)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def load_for(config: EngineConfig) -> tuple[str, PreTrainedTokenizerFast]:
    """The checkpoint dir a config names and the tokenizer it serves with (--tokenizer, --revision,
    --chat-template applied)."""
    model_dir = resolve_model_dir(config.model, config.revision)
    source = hub.resolve(config.tokenizer, config.revision) if config.tokenizer else model_dir
    return model_dir, load_tokenizer(source, config.chat_template)
