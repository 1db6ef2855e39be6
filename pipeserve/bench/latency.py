"""`pipeserve bench latency`: the two tables PPL.LLM publishes, each cell also as % of this machine's
roofline floor.

- First-token latency by input length x batch size: `batch` requests of `input_len` synthetic tokens
  arrive together and each generates one token; the cell is the time of the step(s) that prefill
  them (one step unless --max-batched-tokens splits it), the median of --repeats runs. Cells whose
  batch x input_len exceeds --max-batched-tokens are skipped.
- Decode latency per step by batch size: `batch` requests with --decode-context prompt tokens each
  decode --decode-steps tokens together; the cell is the mean step time after the prefill.

Every cell runs once untimed first (kernel selection, compilation, allocator growth). The JSON fields
are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from pipeserve.bench.harness import Bench, add_engine_arguments, open_bench, pct, run_batch, synthetic_prompts
from pipeserve.bench.report import Panel, Series, plot_panels, print_table, write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--input-len", nargs="+", type=int, default=[8, 32, 128, 512, 2048],
                        help="prompt lengths of the first-token table (those >= the context are dropped)")
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64],
                        help="batch sizes of the first-token table")
    parser.add_argument("--max-batched-tokens", type=int, default=16384,
                        help="the engine's token budget per step; larger prefill cells are skipped")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per first-token cell")
    parser.add_argument("--decode-batch", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                        help="batch sizes of the decode table")
    parser.add_argument("--decode-context", type=int, default=128, help="prompt tokens per decoding request")
    parser.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per batch size")


def prefill_cell(bench: Bench, input_len: int, batch: int, repeats: int,
                 rng: np.random.Generator) -> dict[str, Any]:  # fmt: skip
    engine, vocab = bench.llm.engine, bench.shape.vocab_size
    run_batch(engine, synthetic_prompts(rng, batch, input_len, vocab), 1)
    runs = [run_batch(engine, synthetic_prompts(rng, batch, input_len, vocab), 1) for _ in range(repeats)]
    times = [t.prefill_s for t in runs]
    floor = bench.cost.prefill(input_len, 0, batch)
    ms = statistics.median(times) * 1e3
    return {
        "input_len": input_len,
        "batch": batch,
        "ms": ms,
        "ms_min": min(times) * 1e3,
        "repeats": repeats,
        "steps": runs[0].prefill_steps,
        "floor_ms": floor.t * 1e3,
        "bound": floor.bound,
        "roofline_pct": pct(floor.t * 1e3, ms),
    }


def decode_cell(bench: Bench, batch: int, context: int, steps: int,
                rng: np.random.Generator) -> dict[str, Any]:  # fmt: skip
    engine = bench.llm.engine
    prompts = synthetic_prompts(rng, batch, context, bench.shape.vocab_size)
    run_batch(engine, prompts, 2)
    times = run_batch(engine, prompts, steps + 1).decode_step_s
    # Decode step k attends over context + k tokens (the new one included).
    floor = [bench.cost.decode(batch, context + k) for k in range(1, steps + 1)]
    floor_ms = statistics.fmean(c.t for c in floor) * 1e3
    ms = statistics.fmean(times) * 1e3
    return {
        "batch": batch,
        "context": context,
        "steps": len(times),
        "ms_per_step": ms,
        "ms_p50": statistics.median(times) * 1e3,
        "ms_max": max(times) * 1e3,
        "floor_ms": floor_ms,
        "bound": floor[len(floor) // 2].bound,
        "roofline_pct": pct(floor_ms, ms),
    }


def plot(result: dict[str, Any], path: Path) -> Path:
    ttft = Panel("first-token latency, ms", xlabel="input tokens", logx=True, logy=True,
                 title="prefill (solid: measured, dashed: roofline floor)")  # fmt: skip
    batches = sorted({c["batch"] for c in result["prefill"]})
    for i, batch in enumerate(batches):
        cells = [c for c in result["prefill"] if c["batch"] == batch]
        xs = [c["input_len"] for c in cells]
        ttft.series += [
            Series(f"batch {batch}", xs, [c["ms"] for c in cells], color=f"C{i % 10}"),
            Series(f"batch {batch} floor", xs, [c["floor_ms"] for c in cells], color=f"C{i % 10}",
                   linestyle="--", marker=None),
        ]  # fmt: skip
    cells = result["decode"]
    xs = [c["batch"] for c in cells]
    decode = Panel("ms / decode step", xlabel="batch size", logx=True, logy=True,
                   title=f"decode at context {result['config']['decode_context']}")  # fmt: skip
    decode.series += [
        Series("measured", xs, [c["ms_per_step"] for c in cells], color="C0"),
        Series("roofline floor", xs, [c["floor_ms"] for c in cells], color="C0", linestyle="--", marker=None),
    ]
    model = result["model"]
    title = f"{model['name']} ({model['dtype']}) on {result['rates']['device']}"
    return plot_panels(path, [ttft, decode], title=title)


def main(args: argparse.Namespace) -> int:
    lens, batches, decode_batches = (sorted(set(v)) for v in (args.input_len, args.batch, args.decode_batch))
    if min(lens[0], batches[0], decode_batches[0], args.decode_context, args.decode_steps, args.repeats) < 1:
        raise SystemExit("pipeserve bench latency: lengths, batch sizes, steps and repeats must be >= 1")
    budget = args.max_batched_tokens
    bench = open_bench(args, max(*batches, *decode_batches), budget)
    context = bench.context
    if args.decode_context + args.decode_steps + 1 > context:
        raise SystemExit(f"pipeserve bench latency: --decode-context + --decode-steps exceeds the model's "
                         f"context ({context})")  # fmt: skip
    print(bench.describe())
    rng = np.random.default_rng(args.seed)
    run_batch(bench.llm.engine, synthetic_prompts(rng, 1, 8, bench.shape.vocab_size), 4)  # lazy init
    grid = [(n, b) for n in lens if n < context for b in batches]
    skipped = [{"input_len": n, "batch": b} for n, b in grid if n * b > budget]
    grid = [(n, b) for n, b in grid if n * b <= budget]
    prefill = [
        prefill_cell(bench, n, b, args.repeats, rng) for n, b in tqdm(grid, desc="prefill", unit="cell")
    ]
    decode = [
        decode_cell(bench, b, args.decode_context, args.decode_steps, rng)
        for b in tqdm(decode_batches, desc="decode", unit="cell")
    ]
    result = {
        "bench": "latency",
        **bench.header(args, input_lens=[n for n in lens if n < context], batches=batches,
                       max_batched_tokens=budget, repeats=args.repeats, decode_batches=decode_batches,
                       decode_context=args.decode_context, decode_steps=args.decode_steps),
        "prefill": prefill,
        "skipped": skipped,
        "decode": decode,
    }  # fmt: skip
    print_table(
        "first-token latency (prefill) by input length x batch size",
        ["input", "batch", "ms", "min ms", "floor ms", "bound", "% roofline"],
        [[c["input_len"], c["batch"], c["ms"], c["ms_min"], c["floor_ms"], c["bound"], c["roofline_pct"]]
         for c in prefill],
        caption=f"skipped (over --max-batched-tokens {budget}): {len(skipped)} cells" if skipped else None,
    )  # fmt: skip
    print_table(
        f"decode latency per step by batch size, context {args.decode_context}",
        ["batch", "ms/step", "p50 ms", "max ms", "floor ms", "bound", "% roofline"],
        [[c["batch"], c["ms_per_step"], c["ms_p50"], c["ms_max"], c["floor_ms"], c["bound"],
          c["roofline_pct"]] for c in decode],
    )  # fmt: skip
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    if args.out:
        print(f"wrote {plot(result, Path(args.out) / 'latency.png')}")
    return 0
