"""What every rank of an engine holds: its weights (`load_shard`: the whole model, or with a tensor-
parallel group this rank's shard) and its KV pool (`build_pool`: as many pages as the KV budget
holds, the same number on every rank). Rank 0 (the Engine) builds its scheduler, sampler and
runners on top; ranks 1..T-1 (pipeserve/engine/parallel/worker.py) only a step loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch

from pipeserve import hub
from pipeserve.config import EngineConfig
from pipeserve.demo import ensure_demo_model
from pipeserve.engine.backend import Backend, get_backend, resolve_backend
from pipeserve.engine.kv.pool import KVPool, kv_bytes_per_page
from pipeserve.engine.lora.shard import LoRAShard
from pipeserve.engine.lora.slots import table_bytes
from pipeserve.engine.memory import MemoryPlan, device_probe, kv_budget, profile_step
from pipeserve.engine.model.llama import LlamaForCausalLM
from pipeserve.engine.model.loader import load_model, resolve_dtype
from pipeserve.engine.parallel.group import TPGroup
from pipeserve.engine.quantization.linear import W8A8_DTYPES
from pipeserve.engine.quantization.model import weight_bytes
from pipeserve.model_config import ModelConfig
from pipeserve.startup import phase

log = logging.getLogger(__name__)

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class Shard:
    """One rank's weights, ready to run: quantized as configured, in the backend's layout."""

    model: LlamaForCausalLM  # with tensor parallelism its `config` is this rank's (its heads only)
    model_config: ModelConfig  # the checkpoint's
    model_dir: str
    backend: Backend
    device: torch.device
    dtype: torch.dtype
    max_model_len: int


def load_shard(config: EngineConfig, group: TPGroup | None) -> Shard:
    """This rank's weights: the whole model, or with `group` this rank's shard of it."""
    model_dir = hub.resolve(config.model, config.revision) if config.model else ensure_demo_model()
    model_cfg = ModelConfig.from_dir(model_dir, config.rope_scaling)
    device = resolve_device(config.device) if group is None else group.device
    with phase("preparing the kernel backend (a native build on first use)", log, slow=True):
        backend = get_backend(resolve_backend(config.backend, device))
    dtype = resolve_dtype(config.dtype, device, model_cfg)
    max_model_len = min(config.max_model_len or model_cfg.max_position_embeddings,
                        model_cfg.max_position_embeddings)
    quantized = f", quantized {config.quantization}" if config.quantization != "none" else ""
    # LoRA adapters read the float input of the linears they wrap: W8A8 linears then quantize their
    # own inputs instead of taking them quantized from the norms and the activation.
    fuse_inputs = not config.enable_lora
    if config.quantization in W8A8_DTYPES and not fuse_inputs:
        log.info("%s with LoRA: each W8A8 linear quantizes its own input per token (not fused into the "
                 "norms and the activation), the adapters read the float activations", config.quantization)
    with phase(f"loading {model_dir} on {device}{quantized}", log, slow=True):
        model, model_cfg = load_model(model_dir, backend, device, dtype, max_model_len, group,
                                      config.rope_scaling, quantization=config.quantization,
                                      load_format=config.load_format, seed=config.seed,
                                      fuse_inputs=fuse_inputs)
    backend.prepare_model(model)
    return Shard(model, model_cfg, model_dir, backend, device, dtype, max_model_len)


def build_pool(config: EngineConfig, shard: Shard, group: TPGroup | None, draft_page_bytes: int = 0,
               draft_weight_bytes: int = 0) -> KVPool:
    """The rank's KV pool: the pages its memory holds after its weights and the profiled largest step
    (pipeserve/engine/memory.py), less a draft model's pool of as many pages (`draft_page_bytes` per
    page); the fewest of any rank's when there is a group (a rank's step is a collective of the group,
    so it is not profiled alone)."""
    shard_cfg = shard.model.config
    per_page = kv_bytes_per_page(shard_cfg, shard.dtype, config.page_size, config.kv_cache_dtype,
                                 config.prefix_caching)
    spec_tokens = config.num_speculative_tokens if config.speculative_method != "none" else 0
    with phase("sizing and allocating the KV cache", log):
        profile = None if group is not None else partial(
            profile_step, shard.model, shard.device, shard.dtype, config.page_size, config.kv_cache_dtype,
            shard.max_model_len, config.max_num_batched_tokens, config.max_num_seqs * (1 + spec_tokens))
        probe = device_probe(shard.device)
        # The LoRA slot table is allocated after the pool, for good: the budget leaves room for it.
        reserved = 0
        if config.enable_lora:
            part = None if group is None else LoRAShard(shard.model_config, group.rank, group.world)
            reserved = table_bytes(shard.model_config, config.max_loras, config.max_lora_rank, shard.dtype,
                                   part)
        budget, activations, not_profiled = kv_budget(config, probe, profile, reserved)
        num_pages = config.num_pages or budget // (per_page + draft_page_bytes)
        if group is not None:  # every rank holds the same pages
            num_pages = group.min_int(num_pages)
        pool = KVPool(cfg=shard_cfg, num_pages=num_pages, page_size=config.page_size, dtype=shard.dtype,
                      device=shard.device, max_num_seqs=config.max_num_seqs,
                      max_model_len=shard.max_model_len, kv_cache_dtype=config.kv_cache_dtype,
                      prefix_caching=config.prefix_caching)
        memory = MemoryPlan(weight_bytes(shard.model) + draft_weight_bytes, activations,
                            num_pages * (per_page + draft_page_bytes), num_pages, config.page_size,
                            shard.max_model_len, not_profiled, reserved)
        log.info("%s (%s KV)", memory.line(), config.kv_cache_dtype)
    return pool
