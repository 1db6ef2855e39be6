"""`pipeserve bench throughput`: decode throughput by batch size, against this machine's roofline.

For each batch size, one full batch of identical requests (the same --input-len synthetic token ids,
--output-len tokens each with ignore_eos) runs to completion in the engine, in process: the batch
prefills in one step, then every step decodes all of it. A 2-token run of the same shape goes first
(kernel selection, compilation and allocator growth are not throughput). The JSON fields are in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from pipeserve.bench.harness import Bench, add_engine_arguments, open_bench, pct, run_batch, synthetic_prompts
from pipeserve.bench.report import Panel, Series, plot_panels, print_table, write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                        help="batch sizes measured")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens of every request")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens of every request")
    parser.add_argument("--no-warmup", action="store_true", help="skip the 2-token run before each size")


def measure_point(bench: Bench, batch: int, input_len: int, output_len: int, warmup: bool,
                  rng: np.random.Generator) -> dict[str, Any]:  # fmt: skip
    engine, cost = bench.llm.engine, bench.cost
    prompts = synthetic_prompts(rng, 1, input_len, bench.shape.vocab_size) * batch  # identical requests
    if warmup:
        run_batch(engine, prompts, 2)
    t = run_batch(engine, prompts, output_len)
    steps = len(t.decode_step_s)
    decode_s = sum(t.decode_step_s)
    # Decode step k attends over input_len + k tokens (the new one included).
    floor = [cost.decode(batch, input_len + k) for k in range(1, output_len)]
    floor_s = sum(c.t for c in floor)
    return {
        "batch": batch,
        "prefill_ms": t.prefill_s * 1e3,
        "prefill_steps": t.prefill_steps,
        "floor_prefill_ms": cost.prefill(input_len, 0, batch).t * 1e3,
        "decode_steps": steps,
        "decode_s": decode_s,
        "ms_per_step": decode_s / steps * 1e3 if steps else None,
        "decode_steps_per_s": steps / decode_s if steps else None,
        "decode_tokens_per_s": batch * steps / decode_s if steps else None,
        "generated_tokens": batch * output_len,
        "total_s": t.total_s,
        "tokens_per_s": batch * output_len / t.total_s,
        "floor_ms_per_step": floor_s / steps * 1e3 if steps else None,
        "floor_tokens_per_s": batch * steps / floor_s if steps else None,
        "bound": floor[len(floor) // 2].bound if floor else None,
        "roofline_pct": pct(floor_s, decode_s) if steps else None,
        "preemptions": t.preemptions,
    }


def plot(result: dict[str, Any], path: Path) -> Path:
    pts = [p for p in result["points"] if p["decode_steps"]]
    xs = [p["batch"] for p in pts]
    tput = Panel("decode tokens / s", xlabel="batch size", logx=True, logy=True, title="decode throughput")
    tput.series += [
        Series("measured", xs, [p["decode_tokens_per_s"] for p in pts], color="C0"),
        Series("roofline ceiling", xs, [p["floor_tokens_per_s"] for p in pts], color="C0", linestyle="--"),
    ]
    step = Panel("ms / decode step", xlabel="batch size", logx=True, logy=True, title="decode step time")
    step.series += [
        Series("measured", xs, [p["ms_per_step"] for p in pts], color="C1"),
        Series("roofline floor", xs, [p["floor_ms_per_step"] for p in pts], color="C1", linestyle="--"),
    ]
    cfg, model = result["config"], result["model"]
    title = (f"{model['name']} ({model['dtype']}) on {result['rates']['device']}: "
             f"{cfg['input_len']} in / {cfg['output_len']} out")  # fmt: skip
    return plot_panels(path, [tput, step], title=title)


def main(args: argparse.Namespace) -> int:
    batches = sorted(set(args.batch))
    if batches[0] < 1 or args.input_len < 1 or args.output_len < 2:
        raise SystemExit("pipeserve bench throughput: --batch, --input-len must be >= 1, --output-len >= 2")
    bench = open_bench(args, max(batches), max(batches) * args.input_len)
    if args.input_len + args.output_len > bench.context:
        raise SystemExit(f"pipeserve bench throughput: --input-len + --output-len exceeds the model's "
                         f"context ({bench.context})")  # fmt: skip
    print(bench.describe())
    rng = np.random.default_rng(args.seed)
    run_batch(bench.llm.engine, synthetic_prompts(rng, 1, 8, bench.shape.vocab_size), 4)  # lazy init
    points = [
        measure_point(bench, b, args.input_len, args.output_len, not args.no_warmup, rng)
        for b in tqdm(batches, desc="batch sizes", unit="batch")
    ]
    result = {
        "bench": "throughput",
        **bench.header(args, batches=batches, input_len=args.input_len, output_len=args.output_len,
                       warmup=not args.no_warmup),
        "points": points,
    }  # fmt: skip
    print_table(
        f"decode throughput, {args.input_len} in / {args.output_len} out, identical requests; e2e: the "
        f"whole batch, prefill included; ms/step, steps/s, decode tok/s: the steps after the prefill",
        ["batch", "prefill ms", "ms/step", "steps/s", "decode tok/s", "e2e tok/s",
         "floor ms/step", "ceiling tok/s", "% roofline"],
        [[p["batch"], p["prefill_ms"], p["ms_per_step"], p["decode_steps_per_s"], p["decode_tokens_per_s"],
          p["tokens_per_s"], p["floor_ms_per_step"], p["floor_tokens_per_s"], p["roofline_pct"]]
         for p in points],
    )  # fmt: skip
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    if args.out:
        print(f"wrote {plot(result, Path(args.out) / 'throughput.png')}")
    return 0
