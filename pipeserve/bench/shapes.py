"""The model shapes the benchmarks run, in one place: random-weight Llamas small enough for a 2-core
CPU (nothing to download), and the shared stories260K when it is there."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from pipeserve.bench.workload import shared_dir

# A ~20M-parameter Llama (engine-bound on a 2-core CPU), random weights.
LLAMA_20M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
# The ~18M Llama most step benchmarks use: LLAMA_20M with stories260K's 512-token vocabulary, so
# that it runs with a real tokenizer (`llama_18m_v512`).
LLAMA_18M_V512: dict[str, Any] = LLAMA_20M | {"intermediate_size": 1408, "vocab_size": 512}
# A ~20M Llama with the demo model's byte-level vocabulary (3 specials + 256 bytes): the pipeline's
# own tokenizer, no tokenizer files needed.
LLAMA_20M_BYTES: dict[str, Any] = LLAMA_20M | {"vocab_size": 259, "num_hidden_layers": 7}
# A ~76M Llama (hidden 768, 12 layers, 12 heads / 4 KV heads, head_dim 64) with stories260K's
# 512-token vocabulary: large enough that 64 rows of a step are compute-bound GEMMs on a CPU, with a
# head_dim vLLM's CPU attention takes (the CPU peer comparison, `pipeserve/bench/presets.py`).
LLAMA_76M_V512: dict[str, Any] = LLAMA_20M | {"hidden_size": 768, "intermediate_size": 2048,
                                              "num_hidden_layers": 12, "num_attention_heads": 12,
                                              "vocab_size": 512}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def random_checkpoint(config: dict[str, Any], directory: str, seed: int = 0) -> str:
    """Write an HF checkpoint with random weights for `config` (no tokenizer: ids only)."""
    from safetensors.torch import save_file

    from pipeserve.demo import random_llama_weights

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(random_llama_weights(config, seed), os.path.join(directory, "model.safetensors"))
    return directory


def llama_18m_v512(stories: Path) -> str:
    """The random ~18M Llama (vocab 512) in the cache dir, with stories260K's tokenizer beside it."""
    return vocab512_checkpoint("random-llama-18m-v512", LLAMA_18M_V512, stories, "float32")


def llama_76m_v512(stories: Path, dtype: str = "float32") -> str:
    """The random ~76M Llama (vocab 512) in the cache dir, saved in `dtype` (float32 or bfloat16: the
    same seed's weights, rounded), with stories260K's tokenizer beside it."""
    suffix = "" if dtype == "float32" else f"-{dtype}"
    return vocab512_checkpoint(f"random-llama-76m-v512{suffix}", LLAMA_76M_V512, stories, dtype)


def vocab512_checkpoint(name: str, config: dict[str, Any], stories: Path, dtype: str) -> str:
    """A random checkpoint of `config` named `name` in the cache dir, saved in `dtype`, with
    stories260K's tokenizer files copied beside it (its 512-token vocabulary is the config's)."""
    import torch

    from pipeserve.demo import default_cache_dir, save_random_checkpoint

    target = os.path.join(os.path.dirname(default_cache_dir()), name)
    save_random_checkpoint(target, config | {"torch_dtype": dtype}, dtype=getattr(torch, dtype))
    for file in TOKENIZER_FILES:
        if (stories / file).is_file() and not os.path.isfile(os.path.join(target, file)):
            shutil.copyfile(stories / file, os.path.join(target, file))
    return target


def stories260k() -> str | None:
    """stories260K from the shared folder when it is there (PIPESERVE_SHARED), else None: the demo model."""
    model = shared_dir() / "models" / "stories260K"
    return str(model) if (model / "config.json").is_file() else None
