"""`pipeserve bench moe`: decode steps of a mixture-of-experts model against a dense model with the
same active parameters, in process, on this machine.

Two random-weight checkpoints of the same attention and depth: a Mixtral-style MoE (--experts
experts of --expert-size, top --top-k) and a Llama whose MLP is top_k x expert-size wide, so a
token runs through the same number of weights in both. The MoE holds experts / top_k times the MLP
weights. For each batch size both models decode a full batch (distinct random prompts, so that
rows route to different experts; --output-len tokens, ignore_eos) in turn, --repeats times
alternated, and the median ms per decode step of each is reported beside the roofline floor of
this machine (pipeserve/capacity/roofline.py, measured copy bandwidth and matmul rate) and the expected
distinct experts the batch reads per layer. A 2-token run of each shape goes first.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.bench.harness import run_batch, synthetic_prompts
from pipeserve.bench.machine import floor_cost, measure
from pipeserve.bench.report import machine_info, print_table, write_json
from pipeserve.capacity.roofline import ModelShape
from pipeserve.config import STEP_EXECUTORS

VOCAB = 1024
BASE: dict[str, Any] = {
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": VOCAB,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def configs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The MoE and the dense model with its active parameters, as HF config dicts."""
    shared = BASE | {"hidden_size": args.hidden, "num_hidden_layers": args.layers}
    moe = shared | {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                    "intermediate_size": args.expert_size, "num_local_experts": args.experts,
                    "num_experts_per_tok": args.top_k}  # fmt: skip
    dense = shared | {"architectures": ["LlamaForCausalLM"],
                      "intermediate_size": args.top_k * args.expert_size}
    return {"moe": moe, "dense": dense}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of both models")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of both models")
    parser.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    parser.add_argument("--top-k", type=int, default=2, help="experts each token is routed to")
    parser.add_argument("--expert-size", type=int, default=1024, help="intermediate size of one expert")
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 4, 16, 64],
                        help="decode batch sizes to time")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=5, help="alternated runs of each model per batch size")
    parser.add_argument("--backend", default="cpu", help="engine backend (cpu, reference, triton)")
    parser.add_argument("--step-executor", choices=STEP_EXECUTORS, default="auto",
                        help="how both engines run their steps (auto: the MoE compiled, the dense "
                        "model native)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")


def main(args: argparse.Namespace) -> int:
    import torch

    from pipeserve.demo import default_cache_dir, save_random_checkpoint
    from pipeserve.engine import LLM

    if args.top_k > args.experts or min(args.batch) < 1 or args.output_len < 2 or args.repeats < 1:
        raise SystemExit("pipeserve bench moe: need --top-k <= --experts, --batch >= 1, --output-len >= 2, "
                         "--repeats >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    rates = measure(torch.device("cpu"), torch.float32)
    root = Path(default_cache_dir()).parent
    models, shapes, costs = {}, {}, {}
    max_batch = max(args.batch)
    for name, config in configs(args).items():
        tag = (f"bench-moe-{name}-h{args.hidden}-l{args.layers}-e{args.experts}-k{args.top_k}"
               f"-i{args.expert_size}")
        path = save_random_checkpoint(str(root / tag), config, seed=args.seed, dtype=torch.float32)
        models[name] = LLM(path, device="cpu", dtype="float32", backend=args.backend, max_num_seqs=max_batch,
                           max_num_batched_tokens=max_batch * args.input_len,
                           step_executor=args.step_executor)
        shapes[name] = ModelShape.from_path(path)
        costs[name] = floor_cost(shapes[name], rates, torch.float32)
    rng = np.random.default_rng(args.seed)
    points = []
    for batch in sorted(set(args.batch)):
        # Distinct prompts: identical requests would route every row to the same experts.
        prompts = synthetic_prompts(rng, batch, args.input_len, VOCAB)
        steps: dict[str, list[float]] = {name: [] for name in models}
        for llm in models.values():
            run_batch(llm.engine, prompts, 2)  # warm-up of this shape
        for _ in range(args.repeats):  # alternated, so drifting load hits both alike
            for name, llm in models.items():
                t = run_batch(llm.engine, prompts, args.output_len)
                steps[name].append(statistics.median(t.decode_step_s) * 1e3)
        context = args.input_len + args.output_len // 2
        point: dict[str, Any] = {"batch": batch}
        for name in models:
            point[name] = {
                "ms_per_step": statistics.median(steps[name]),
                "ms_per_step_min": min(steps[name]),  # the least disturbed run, on a loaded machine
                "ms_per_step_runs": steps[name],
                "floor_ms_per_step": costs[name].decode(batch, context).t * 1e3,
            }
        point["moe_over_dense"] = point["moe"]["ms_per_step"] / point["dense"]["ms_per_step"]
        point["moe_over_dense_min"] = point["moe"]["ms_per_step_min"] / point["dense"]["ms_per_step_min"]
        point["experts_touched"] = shapes["moe"].experts_touched(batch)
        points.append(point)
    moe, dense = shapes["moe"], shapes["dense"]
    result = {
        "bench": "moe",
        "machine": {**machine_info(), "load_average": {"start": load_start, "end": os.getloadavg()}},
        "rates": rates.to_json(),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "models": {
            "moe": {"params": moe.params, "active_params": moe.active_params, "experts": args.experts,
                    "top_k": args.top_k},
            "dense": {"params": dense.params, "active_params": dense.active_params},
        },
        "points": points,
    }  # fmt: skip
    print(f"MoE {moe.params / 1e6:.3g} M params ({moe.active_params / 1e6:.3g} M active, {args.top_k} of "
          f"{args.experts} experts) vs dense {dense.params / 1e6:.3g} M; medians of {args.repeats} "
          f"alternated runs, {args.input_len} in / {args.output_len} out, "
          f"backend {args.backend}")  # fmt: skip
    print_table(
        "decode step, ms (floor: this machine's roofline)",
        ["batch", "experts read", "MoE ms", "dense ms", "MoE / dense", "min: MoE ms", "dense ms",
         "MoE / dense", "MoE floor", "dense floor"],
        [[p["batch"], p["experts_touched"], p["moe"]["ms_per_step"], p["dense"]["ms_per_step"],
          p["moe_over_dense"], p["moe"]["ms_per_step_min"], p["dense"]["ms_per_step_min"],
          p["moe_over_dense_min"], p["moe"]["floor_ms_per_step"], p["dense"]["floor_ms_per_step"]]
         for p in points],
    )  # fmt: skip
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    return 0
