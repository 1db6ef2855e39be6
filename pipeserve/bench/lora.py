"""`pipeserve bench lora`: batched multi-LoRA throughput and inter-token latency, in process.

The model: the random ~18M Llama (bench/shapes.py, vocab 512) or --model. Adapters: random PEFT
directories (adapter_config.json + adapter_model.safetensors) of --rank on --targets, written once
into a temporary folder. The workload: --requests greedy requests (--prompt-len prompt tokens,
--output tokens each, ignore_eos), all queued at the start, --max-num-seqs running at once; request i
runs adapter i mod n for n distinct adapters in {--adapters}, or the base model (n = 0). Every case
runs on one engine with --enable-lora (--max-loras slots, at least the batch so that no case waits for
a slot), alternated over --repeats (the order rotates each repetition) after a warm-up of each. The
base model also runs on an engine without LoRA (its own step executor: the native step on the CPU),
measured in the same rotation. Figures, medians over the repetitions: generated tokens over the wall
time, and the inter-token latency (p50 / p99 over every request's gaps between tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import numpy as np

from pipeserve.bench.metrics import stats
from pipeserve.bench.report import machine_info, print_table, write_json
from pipeserve.bench.workload import shared_dir
from pipeserve.config import EngineConfig

# (distinct adapters, the least tokens/s relative to the base model on the same engine)
TARGETS = {4: 0.75, 16: 0.6}
TARGETS_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE, PLAIN = "base", "base (engine without LoRA)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the random ~18M Llama)")
    parser.add_argument("--adapters", default="1,4,16,64",
                        help="distinct adapter counts (comma-separated)")
    parser.add_argument("--rank", type=int, default=8, help="adapter rank")
    parser.add_argument("--targets", default=",".join(TARGETS_ALL),
                        help="target modules (default: all linear)")
    parser.add_argument("--requests", type=int, default=64, help="requests per run")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once (the batch)")
    parser.add_argument("--max-loras", type=int, default=0, help="slots (0: the batch)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of every request")
    parser.add_argument("--output", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of every case, alternated")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: the engine's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and adapters")
    parser.add_argument("--json", metavar="PATH", help="write the full results as JSON")


def write_adapter(path: str, model_dir: str, rank: int, targets: list[str], seed: int) -> None:
    """A random PEFT adapter of model_dir: A ~ U(+-1/sqrt(in)) as PEFT initializes it, B ~ N(0, 0.02)
    (nonzero, so the adapter changes the output), alpha = 2 * rank."""
    import torch
    from safetensors.torch import save_file

    from pipeserve.engine.lora.layout import projection_sizes
    from pipeserve.model_config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    sizes = projection_sizes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in targets:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            d_in, d_out = sizes[module]
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            bound = d_in ** -0.5
            tensors[f"{key}.lora_A.weight"] = (torch.rand(rank, d_in, generator=gen) * 2 - 1) * bound
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
                   "lora_dropout": 0.0, "bias": "none", "use_rslora": False}, f)


def run_once(engine: Any, args: argparse.Namespace, loras: list[Any], tag: str) -> dict[str, Any]:
    from pipeserve.sampling_params import SamplingParams

    rng = np.random.default_rng(args.seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output, ignore_eos=True, temperature=0.0)
    for i in range(args.requests):
        lora = loras[i % len(loras)] if loras else None
        kwargs = {"lora": lora} if lora is not None else {}
        engine.add(f"{tag}-{i}", rng.integers(1, vocab, args.prompt_len).tolist(), params, **kwargs)
    swaps = engine.stats().get("lora_swaps", 0)
    last: dict[str, float] = {}
    gaps: list[float] = []
    tokens = 0
    start = time.perf_counter()
    while engine.has_work():
        updates = engine.step()
        now = time.perf_counter()
        for u in updates:
            if u.token_ids:
                tokens += len(u.token_ids)
                if u.rid in last:
                    gaps.append(now - last[u.rid])
                last[u.rid] = now
    wall = time.perf_counter() - start
    assert tokens == args.requests * args.output, (tokens, args.requests * args.output)
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "itl_s": stats(gaps),
            "swaps": engine.stats().get("lora_swaps", 0) - swaps}


def main(args: argparse.Namespace) -> int:
    counts = [int(n) for n in args.adapters.split(",") if n.strip()]
    if min([args.requests, args.max_num_seqs, args.output, args.repeats, args.prompt_len, *counts]) < 1:
        raise SystemExit("pipeserve bench lora: counts and lengths must be >= 1")
    from pipeserve.bench.shapes import llama_18m_v512
    from pipeserve.engine.engine import Engine
    from pipeserve.lora import LoRARequest

    model = args.model or llama_18m_v512(shared_dir() / "models" / "stories260K")
    targets = [t for t in args.targets.split(",") if t]
    common = dict(model=model, device="cpu", dtype="float32", max_num_seqs=args.max_num_seqs,
                  cpu_threads=args.threads, prefix_caching=False)
    slots = args.max_loras or args.max_num_seqs
    with tempfile.TemporaryDirectory(prefix="pipeserve-bench-lora-") as tmp:
        adapters = []
        for i in range(max(counts)):
            path = os.path.join(tmp, f"adapter{i}")
            write_adapter(path, model, args.rank, targets, args.seed + i)
            adapters.append(LoRARequest(f"adapter{i}", i + 1, path))
        lora_engine = Engine(EngineConfig(**common, enable_lora=True, max_loras=slots,
                                          max_lora_rank=args.rank, max_cpu_loras=max(slots, max(counts))))
        plain_engine = Engine(EngineConfig(**common))
        cases: dict[str, tuple[Any, list[Any]]] = {PLAIN: (plain_engine, []), BASE: (lora_engine, [])}
        for n in counts:
            cases[f"{n} adapters"] = (lora_engine, adapters[:n])
        names = list(cases)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for rep in range(-1, args.repeats):  # -1: an unmeasured warm-up of each
            shift = max(rep, 0) % len(names)
            for name in names[shift:] + names[:shift]:
                engine, loras = cases[name]
                result = run_once(engine, args, loras, f"{name}-{rep}".replace(" ", "_"))
                if rep >= 0:
                    runs[name].append(result)
    summary = {name: {
        "tokens_per_s": float(np.median([r["tokens_per_s"] for r in runs[name]])),
        "itl_p50_ms": 1e3 * float(np.median([r["itl_s"]["p50"] for r in runs[name]])),
        "itl_p99_ms": 1e3 * float(np.median([r["itl_s"]["p99"] for r in runs[name]])),
        "swaps": float(np.median([r["swaps"] for r in runs[name]])),
    } for name in names}
    base = summary[BASE]["tokens_per_s"]
    plain = summary[PLAIN]["tokens_per_s"]
    for s in summary.values():
        s["vs_base"] = s["tokens_per_s"] / base
        s["vs_plain"] = s["tokens_per_s"] / plain
    print_table(f"LoRA rank {args.rank} ({len(targets)} target modules), batch {args.max_num_seqs}, "
                f"{args.requests} requests x {args.output} tokens",
                ["case", "tok/s", "x base", "x base w/o LoRA", "ITL p50 ms", "p99 ms", "swaps"],
                [[name, f"{s['tokens_per_s']:.0f}", f"{s['vs_base']:.2f}", f"{s['vs_plain']:.2f}",
                  f"{s['itl_p50_ms']:.1f}", f"{s['itl_p99_ms']:.1f}", f"{s['swaps']:.0f}"]
                 for name, s in summary.items()])
    met = {n: summary[f"{n} adapters"]["vs_base"] >= want for n, want in TARGETS.items()
           if f"{n} adapters" in summary}
    for n, ok in met.items():
        ratio = summary[f"{n} adapters"]["vs_base"]
        print(f"{n} adapters: {ratio:.2f}x the base model's tokens/s on the same engine (target >= "
              f"{TARGETS[n]}): {'met' if ok else 'NOT met'}")
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": machine_info(), "summary": summary,
                               "targets": TARGETS, "met": met, "runs": runs})
    return 0
