"""What the in-process engine benchmarks (`bench throughput`, `bench latency`) share: their engine
flags, the model (a checkpoint, a roofline preset built with random weights, or the demo model),
this machine's roofline floor, synthetic prompts, and timing one batch step by step.

Requests are synthetic token ids with ignore_eos and greedy sampling, so every run generates exactly
the tokens asked for. The floor is the roofline cost model on rates measured in the same run
(pipeserve/bench/machine.py); "% of roofline" is floor time / measured time x 100 (100 = at the floor).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeserve.bench.machine import MachineRates, floor_cost, measure
from pipeserve.bench.report import machine_info
from pipeserve.capacity.roofline import PRESETS, CostModel, ModelShape
from pipeserve.config import BACKENDS

_ids = itertools.count()


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help=f"HF checkpoint dir, or a roofline preset ({', '.join(PRESETS)}) built with random "
        "weights in the cache dir; default: the demo model",
    )
    parser.add_argument("--device", default="auto", help="auto: cuda when available")
    parser.add_argument("--dtype", default="auto", help="auto: checkpoint dtype on CUDA, float32 on CPU")
    parser.add_argument("--backend", default="auto", choices=("auto", *BACKENDS),
                        help="kernel backend, as the engine's --backend; auto: triton on CUDA, cpu elsewhere")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--kv-cache-gb", type=float, default=None, help="KV pool size (default: engine's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for the engine and the measurement (default: torch's); "
                        "1 is steadier on a machine other work is loading")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    parser.add_argument("--json", metavar="PATH", help="write the full results as JSON")
    parser.add_argument("--out", metavar="DIR", help="write the PNG plots into DIR")


def preset_config(shape: ModelShape) -> dict[str, Any]:
    """An HF config.json for a roofline preset. rope_theta and eps are generic: with random weights
    they change no timing."""
    model_type = "qwen2" if shape.layer_bias_params else "mistral" if shape.sliding_window else "llama"
    if shape.num_experts:  # Mixtral's experts are as wide as its intermediate_size; Qwen3-MoE's are not
        model_type = "mixtral" if shape.moe_intermediate_size == shape.intermediate_size else "qwen3_moe"
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
    config: dict[str, Any] = {
        "architectures": [arch[model_type]],
        "model_type": model_type,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    if shape.sliding_window:
        config["sliding_window"] = shape.sliding_window
    if model_type == "mixtral":
        config |= {"num_local_experts": shape.num_experts, "num_experts_per_tok": shape.experts_per_tok}
    elif model_type == "qwen3_moe":
        config |= {"num_experts": shape.num_experts, "num_experts_per_tok": shape.experts_per_tok,
                   "moe_intermediate_size": shape.moe_intermediate_size, "norm_topk_prob": True,
                   "decoder_sparse_step": 1, "mlp_only_layers": []}
    return config


def resolve_model(spec: str | None) -> str:
    """A checkpoint dir as given; a preset name becomes a random-weight checkpoint in the cache dir;
    None is the demo model."""
    from pipeserve.demo import default_cache_dir, ensure_demo_model, save_random_checkpoint

    if spec is None:
        return ensure_demo_model()
    if spec.lower() not in PRESETS:
        return spec

    target = os.path.join(os.path.dirname(default_cache_dir()), f"random-{spec.lower()}")
    return save_random_checkpoint(target, preset_config(PRESETS[spec.lower()]))


@dataclass
class Bench:
    """An engine, the shape the roofline costs and this machine's floor."""

    llm: Any  # pipeserve.engine.LLM
    shape: ModelShape
    rates: MachineRates
    cost: CostModel
    info: dict[str, Any]  # the engine's model_info()
    load_start: tuple[float, float, float] = field(default_factory=os.getloadavg)

    @property
    def context(self) -> int:
        return int(self.info["context_length"])

    def header(self, args: argparse.Namespace, **config: Any) -> dict[str, Any]:
        """The JSON fields every engine bench starts with."""
        return {
            # Other work on the machine slows every cell: the 1/5/15-minute load averages tell.
            "machine": {**machine_info(), "load_average": {"start": self.load_start, "end": os.getloadavg()}},
            "rates": self.rates.to_json(),
            "model": {**self.info, "path": args.model, "params": self.shape.params},
            "floor": {
                "weight_bytes_read": self.cost.weight_bytes_read,
                "kv_bytes_per_token": self.cost.kv_bytes_per_token,
            },
            "config": config,
        }

    def describe(self) -> str:
        r = self.rates
        return (
            f"{self.info['name']} ({self.shape.params / 1e6:.3g} M params, {self.info['dtype']}, "
            f"{self.info['backend']}) on {r.device}: measured {r.copy_bandwidth / 1e9:.3g} GB/s copy, "
            f"{r.matmul_flops / 1e9:.4g} GFLOP/s {r.dtype} matmul"
        )


def open_bench(args: argparse.Namespace, max_num_seqs: int, max_num_batched_tokens: int) -> Bench:
    """Measure this machine, then load the engine (the measurement's buffers are gone by then)."""
    import torch

    from pipeserve.engine import LLM
    from pipeserve.engine.model.loader import resolve_dtype
    from pipeserve.engine.shard import resolve_device
    from pipeserve.model_config import ModelConfig

    model_dir = resolve_model(args.model)
    options: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "backend": args.backend,
                               "page_size": args.page_size, "max_num_seqs": max_num_seqs,
                               "max_num_batched_tokens": max_num_batched_tokens}  # fmt: skip
    if args.kv_cache_gb is not None:
        options["kv_cache_gb"] = args.kv_cache_gb
    device = resolve_device(args.device)
    dtype: torch.dtype = resolve_dtype(args.dtype, device, ModelConfig.from_dir(model_dir))
    if args.threads:
        torch.set_num_threads(args.threads)
    rates = measure(device, dtype)
    llm = LLM(model_dir, **options)
    shape = ModelShape.from_path(model_dir)
    return Bench(llm, shape, rates, floor_cost(shape, rates, dtype), llm.engine.model_info())


def synthetic_prompts(rng: np.random.Generator, n: int, length: int, vocab: int) -> list[list[int]]:
    """n prompts of uniformly random token ids (no text: the benches skip tokenization)."""
    return rng.integers(0, vocab, size=(n, length)).tolist()


@dataclass
class BatchTiming:
    """One batch run to completion. prefill_s: from the first step until every request has its first
    token (prefill_steps steps); decode_step_s: every later step; outputs: each prompt's token ids.
    wall_s and first_token_s: from before the first add to the end, and to the step that gave the
    last request its first token, by the wall clock (the adds and the loop around the steps included)."""

    prefill_s: float
    prefill_steps: int
    decode_step_s: list[float] = field(default_factory=list)
    preemptions: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    wall_s: float = 0.0
    first_token_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.prefill_s + sum(self.decode_step_s)


def run_batch(engine: Any, prompts: list[list[int]], output_len: int) -> BatchTiming:
    """Add every prompt at once (ignore_eos, greedy, max_tokens=output_len), step until all finish and
    time each step. Raises if a request ended with a different number of tokens."""
    from pipeserve.engine import SamplingParams

    preempted = engine.stats()["preemptions"]
    tag = next(_ids)
    began = time.perf_counter()
    generated: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        rid = f"bench-{tag}-{i}"
        engine.add(rid, prompt, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0))
        generated[rid] = []
    waiting_first = len(prompts)
    timing = BatchTiming(0.0, 0)
    while engine.has_work():
        start = time.perf_counter()
        step = engine.step()
        elapsed = time.perf_counter() - start
        if waiting_first:
            timing.prefill_s += elapsed
            timing.prefill_steps += 1
        else:
            timing.decode_step_s.append(elapsed)
        for update in step:
            if update.token_ids:
                tokens = generated[update.rid]
                if not tokens:
                    waiting_first -= 1
                    if not waiting_first:
                        timing.first_token_s = time.perf_counter() - began
                tokens += update.token_ids
    timing.wall_s = time.perf_counter() - began
    short = {rid: len(t) for rid, t in generated.items() if len(t) != output_len}
    if short:
        raise RuntimeError(f"{len(short)} requests did not generate {output_len} tokens: {short}")
    timing.preemptions = engine.stats()["preemptions"] - preempted
    timing.outputs = list(generated.values())
    return timing


def pct(floor_s: float, measured_s: float) -> float:
    """% of roofline: the floor's share of the measured time (100 = at the speed of light)."""
    return 100.0 * floor_s / measured_s
