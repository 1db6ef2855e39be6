"""A model's tokenizer, without importing torch (`from transformers import AutoTokenizer` pulls torch
in; PreTrainedTokenizerFast does not). The limits prompts are checked against come from the one
config reader, pipeserve.model_config, which the engine uses too.

Checkpoints that ship only a slow SentencePiece tokenizer (`tokenizer.model`, no `tokenizer.json`)
are converted to a fast one as transformers does, once: the result is written to the pipeserve
cache (keyed by the tokenizer files' contents), so every worker process loads it as it loads any
fast tokenizer."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import zmq
from transformers import PreTrainedTokenizerFast

from pipeserve import config as cfg
from pipeserve import hub
from pipeserve.config import Addresses, EngineConfig, cache_dir, engine_endpoints
from pipeserve.model_config import ModelLimits, model_limits

__all__ = ["ModelLimits", "add_worker_arguments", "load_for", "load_tokenizer", "model_limits",
           "read_chat_template", "resolve_model_dir", "start_worker", "worker_sockets"]

# The files a slow tokenizer's conversion reads: the cache key of the converted one.
SLOW_TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                        "added_tokens.json", "chat_template.jinja")


def resolve_model_dir(model: str | None, revision: str | None = None) -> str:
    """The checkpoint dir of a path or hub id; None means the built-in demo model (building it imports
    torch, once)."""
    if model:
        return hub.resolve(model, revision)
    from pipeserve.engine.model.demo import ensure_demo_model

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


# ---- the processes that hold the tokenizer (tokenizer and detokenizer workers) --------------------


def add_worker_arguments(parser: argparse.ArgumentParser, sockets: dict[str, str]) -> None:
    """A worker's flags: which tokenizer (EngineConfig's tokenizer fields), its sockets ({Addresses
    field: what the worker does with it}) and the log level."""
    cfg.add_arguments(parser, EngineConfig, only=cfg.TOKENIZER_FIELDS)
    addresses = Addresses()
    for name, role in sockets.items():
        parser.add_argument(f"--{name}", default=getattr(addresses, name), help=role)
    parser.add_argument("--log-level", default="INFO", help="logging level")


def start_worker(args: argparse.Namespace, name: str) -> EngineConfig:
    """Logging, SIGTERM as a clean exit, and the worker's EngineConfig (--model defaults to
    $PIPESERVE_MODEL, which the launcher and compose set for every process)."""
    logging.basicConfig(level=args.log_level.upper(), force=True,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    args.model = args.model or os.environ.get("PIPESERVE_MODEL")
    config: EngineConfig = cfg.from_args(EngineConfig, args)
    return config


def connect_engines(ctx: zmq.Context[zmq.Socket[bytes]], endpoints: str) -> list[zmq.Socket[bytes]]:
    """One PUSH socket per engine (a requests or control address lists one endpoint per engine):
    element i reaches engine i only, so a request and its aborts go where the gateway routed it."""
    sockets = []
    for endpoint in engine_endpoints(endpoints):
        sock = ctx.socket(zmq.PUSH)
        sock.connect(endpoint)
        sockets.append(sock)
    return sockets


@contextmanager
def worker_sockets() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """The worker's ZeroMQ context for the life of its serve loop; Ctrl-C is a clean exit, and queued
    messages get half a second to leave."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield ctx
    except KeyboardInterrupt:
        pass
    finally:
        ctx.destroy(linger=500)
