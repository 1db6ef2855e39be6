"""`pipeserve bench spec`: speculative decoding on vs off, in process, greedy.

Models: stories260K and a ~18M Llama with random weights and stories260K's tokenizer (bench
structured's model). Workloads: (a) copy-heavy, a story passage followed by its own opening, so the
continuation can copy from the prompt; (b) open-ended, short story openings. Batch 1 (the requests
one after another) and batch 32 (all at once). Variants, alternated within each repeat: no
speculation, n-gram prompt lookup (the adaptive rule on, as served by default), and a draft model
(the model itself unless --draft is given: a draft that always agrees) proposing a fixed k
(--no-speculative-adaptive), which shows what verification gives back per target step.

Per case and variant: the wall time (median over --repeats), the acceptance rate (kept / proposed
tokens), the mean tokens per target step (generated tokens, less each request's first, over the
target rows that produced them: 1 without speculation), and the speedup over no speculation: the
median over repeats of the baseline's time over the variant's run beside it, in wall-clock time and
in the process's CPU time (one torch thread: on a shared machine the CPU time leaves out the time
the process waited for a core). Each engine generates the
case once, untimed, before the repeats (warm-up; the adaptive rule keeps learning throughout); the
repeats rotate which variant goes first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from pipeserve.bench.report import Panel, Series, machine_info, plot_panels, print_table, write_json
from pipeserve.bench.shapes import llama_18m_v512
from pipeserve.bench.workload import BatchSizes, shared_dir

PASSAGES = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day, "
    "she saw a big red ball in the park. She ran to the ball and kicked it high into the sky.",
    "Tom had a small dog named Max. Max liked to run and jump in the garden. Every morning, Tom gave Max "
    "a bone and they played together until it was time for school.",
    "There was a big tree near the house. A happy bird lived in the tree with her three babies. The bird "
    "sang a song every day, and the babies listened and smiled.",
    "Sue and her mom went to the store to buy some food. They bought apples, bread and milk. On the way "
    "home, Sue saw a cat sitting on a wall, and she waved at the cat.",
]
OPENINGS = ["Once upon a time", "One day", "Tom and Sue", "The little dog", "There was a big", "Lily was sad"]
OPENING_TOKENS = 12  # of the passage, repeated after it in the copy-heavy prompts
VARIANTS = ("off", "ngram", "draft")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="stories260K,llama-18m",
                        help="comma-separated: stories260K, llama-18m, or checkpoint dirs")
    parser.add_argument("--draft", default=None, help="draft checkpoint (default: each model itself)")
    parser.add_argument("--batch", "--batches", dest="batch", action=BatchSizes, default=[1, 32],
                        help="batch sizes (--batches 1,32: the former spelling)")
    parser.add_argument("--requests-at-1", type=int, default=6, help="requests run one by one at batch 1")
    parser.add_argument("--output-len", type=int, default=48, help="tokens generated per request")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each variant, alternated")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is steadiest)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of speedups and tokens per step")


def prompts_for(tokenizer: Any, workload: str, n: int) -> list[list[int]]:
    if workload == "copy":
        ids = [tokenizer(p).input_ids for p in PASSAGES]
        base = [p + p[1 : OPENING_TOKENS + 1] for p in ids]  # the opening again, without BOS
    else:
        base = [tokenizer(p).input_ids for p in OPENINGS]
    return [base[i % len(base)] for i in range(n)]


def run_case(llm: Any, prompts: list[list[int]], batch: int, output_len: int) -> dict[str, float]:
    from pipeserve.engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    before = llm.engine.stats()
    start, cpu = time.perf_counter(), time.process_time()
    outs = []
    groups = [prompts] if batch > 1 else [[p] for p in prompts]
    for group in groups:
        outs += llm.generate(group, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    after = llm.engine.stats()
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    proposed = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    decoded = sum(len(o.token_ids) for o in outs) - len(outs)  # the first token comes with the prompt
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "accepted": accepted,
        "proposed": proposed,
        "tokens_per_target_step": decoded / max(decoded - accepted, 1),
    }


def paired(base: list[dict[str, float]], runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(b[key] / r[key] for b, r in zip(base, runs, strict=True))


def plot(path: str, results: list[dict[str, Any]]) -> None:
    """Speedups and tokens per target step by case; the cases, numbered, in the title."""
    cases = sorted({(r["model"], r["workload"], r["batch"]) for r in results})
    x = list(range(len(cases)))

    def series(key: str, variant: str) -> Series:
        by_case = {(r["model"], r["workload"], r["batch"]): r[key]
                   for r in results if r["variant"] == variant}
        return Series(variant, x, [by_case[c] for c in cases])

    key = ", ".join(f"{i}: {m} {w} b{b}" for i, (m, w, b) in enumerate(cases))
    plot_panels(path, [
        Panel("wall-clock speedup vs off", [series("speedup", v) for v in ("ngram", "draft")], "case"),
        Panel("CPU-time speedup vs off", [series("cpu_speedup", v) for v in ("ngram", "draft")], "case"),
        Panel("tokens per target step", [series("tokens_per_target_step", v) for v in VARIANTS], "case"),
    ], f"pipeserve bench spec ({key})")


def main(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from pipeserve.engine import LLM

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    stories = shared_dir() / "models" / "stories260K"
    results: list[dict[str, Any]] = []
    batches = list(args.batch)
    for name in args.models.split(","):
        model = {"stories260K": str(stories), "llama-18m": None}.get(name, name)
        if model is None:
            model = llama_18m_v512(stories)
        if not Path(model, "config.json").is_file():
            raise SystemExit(f"bench spec: {model} is not a checkpoint (PIPESERVE_SHARED: stories260K)")
        tokenizer = AutoTokenizer.from_pretrained(model)
        common = dict(device="cpu", dtype="float32", max_num_seqs=max(batches), num_speculative_tokens=args.k)
        llms = {
            "off": LLM(model, **common),
            "ngram": LLM(model, speculative_method="ngram", **common),
            # A fixed k: the figure is what a draft that agrees gives back per target step.
            "draft": LLM(model, speculative_method="draft", draft_model=args.draft or model,
                         speculative_adaptive=False, **common),
        }
        for workload in ("copy", "open"):
            for batch in batches:
                prompts = prompts_for(tokenizer, workload, args.requests_at_1 if batch == 1 else batch)
                runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
                for variant in VARIANTS:  # warm-up
                    run_case(llms[variant], prompts, batch, args.output_len)
                for rep in range(args.repeats):  # alternated, each variant first in turn
                    for variant in VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]:
                        runs[variant].append(run_case(llms[variant], prompts, batch, args.output_len))
                for variant in VARIANTS:
                    rs, off = runs[variant], runs["off"]
                    proposed = sum(r["proposed"] for r in rs)
                    results.append({
                        "model": name,
                        "workload": workload,
                        "batch": batch,
                        "variant": variant,
                        "wall_s": statistics.median(r["wall_s"] for r in rs),
                        "walls_s": [r["wall_s"] for r in rs],
                        "cpus_s": [r["cpu_s"] for r in rs],
                        # Paired: each repeat's baseline over the variant's run beside it.
                        "speedup": paired(off, rs, "wall_s"),
                        "cpu_speedup": paired(off, rs, "cpu_s"),
                        "acceptance": sum(r["accepted"] for r in rs) / proposed if proposed else None,
                        "tokens_per_target_step": statistics.median(r["tokens_per_target_step"] for r in rs),
                    })
    rows = [[r["model"], r["workload"], r["batch"], r["variant"], r["wall_s"], r["speedup"], r["cpu_speedup"],
             r["acceptance"], r["tokens_per_target_step"], r["speedup"] / r["tokens_per_target_step"]]
            for r in results]
    print_table("speculative decoding (greedy)",
                ["model", "workload", "batch", "variant", "wall s", "speedup", "cpu speedup", "acceptance",
                 "tokens/step", "speedup / (tokens/step)"], rows)
    if args.json:
        write_json(args.json, {"machine": machine_info(), "loadavg_start": load_start,
                               "loadavg_end": os.getloadavg(), "args": vars(args), "results": results})
    if args.plot:
        plot(args.plot, results)
    return 0
