"""`pipeserve bench priority`: interactive requests overtaking a batch flood, fcfs vs priority, in
process on stories260K (the shared assets) or a checkpoint dir.

The flood: --batch requests at priority 0 (--prompt-len prompt tokens, --batch-output tokens each,
greedy, ignore_eos), all queued at the start, more than --max-num-seqs seats. Interactive requests:
one at priority -1 every --every engine steps (--interactive in all, --interactive-output tokens),
injected by step count so both policies see the same arrivals. The same engine config runs the
workload under --scheduling-policy fcfs and priority, alternated over --repeats (which goes first
alternates too). Figures, medians over the repetitions: TTFT (submission to first token) p50/p99 of
the interactive requests; throughput: every generated token (flood and interactive) over the time
until the last request finished (the target's figure: under fcfs the interactive requests run after
the flood, under priority inside it, so this compares the same work); and the flood's tokens over
the time until its own last request finished.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from pipeserve.bench.metrics import stats
from pipeserve.bench.report import machine_info, print_table, write_json
from pipeserve.bench.workload import shared_dir
from pipeserve.config import EngineConfig

POLICIES = ("fcfs", "priority")
TARGETS = {"ttft_p50_ratio": 1 / 3, "throughput_within": 0.10}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (default: stories260K, shared assets)")
    parser.add_argument("--batch", type=int, default=64, help="flood requests at priority 0")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of every request")
    parser.add_argument("--batch-output", type=int, default=64, help="tokens generated per flood request")
    parser.add_argument("--interactive", type=int, default=16, help="interactive requests at priority -1")
    parser.add_argument("--interactive-output", type=int, default=8, help="tokens per interactive request")
    parser.add_argument("--every", type=int, default=8, help="engine steps between interactive arrivals")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="the engine's seats")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of both policies, alternated")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: the engine's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--json", metavar="PATH", help="write the full results as JSON")


def run_once(engine: Any, args: argparse.Namespace, rng: np.random.Generator, tag: str) -> dict[str, Any]:
    from pipeserve.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size

    def prompt() -> list[int]:
        return rng.integers(1, vocab, args.prompt_len).tolist()

    def params(n: int, priority: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, priority=priority)

    start = time.perf_counter()
    submitted: dict[str, float] = {}
    for i in range(args.batch):
        rid = f"{tag}-b{i}"
        engine.add(rid, prompt(), params(args.batch_output, 0))
        submitted[rid] = start
    first: dict[str, float] = {}
    batch_done = start
    interactive_tokens = args.interactive * args.interactive_output
    batch_left = args.batch
    sent, step = 0, 0
    while engine.has_work() or sent < args.interactive:
        if sent < args.interactive and step % args.every == 0:
            rid = f"{tag}-i{sent}"
            submitted[rid] = time.perf_counter()
            engine.add(rid, prompt(), params(args.interactive_output, -1))
            sent += 1
        updates = engine.step()
        step += 1
        now = time.perf_counter()
        for u in updates:
            if u.token_ids:
                first.setdefault(u.rid, now - submitted[u.rid])
            if u.finish_reason and "-b" in u.rid:
                batch_left -= 1
                batch_done = now
    assert batch_left == 0
    ttft = [first[f"{tag}-i{i}"] for i in range(args.interactive)]
    end = time.perf_counter()
    flood_tokens = args.batch * args.batch_output
    return {"ttft_s": stats(ttft), "tokens_per_s": (flood_tokens + interactive_tokens) / (end - start),
            "batch_tokens_per_s": flood_tokens / (batch_done - start), "steps": step}


def main(args: argparse.Namespace) -> int:
    if min(args.batch, args.interactive, args.every, args.repeats, args.prompt_len) < 1:
        raise SystemExit("pipeserve bench priority: counts and lengths must be >= 1")
    from pipeserve.engine.engine import Engine

    model = args.model or str(shared_dir() / "models" / "stories260K")
    engines = {p: Engine(EngineConfig(model=model, device="cpu", dtype="float32", scheduling_policy=p,
                                      max_num_seqs=args.max_num_seqs, cpu_threads=args.threads))
               for p in POLICIES}
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    for rep in range(-1, args.repeats):  # -1: an unmeasured warm-up of each
        order = POLICIES if rep % 2 == 0 else POLICIES[::-1]
        for p in order:
            result = run_once(engines[p], args, np.random.default_rng(args.seed + max(rep, 0)), f"{p}{rep}")
            if rep >= 0:
                runs[p].append(result)
    summary: dict[str, dict[str, float]] = {}
    for p in POLICIES:
        summary[p] = {
            "ttft_p50_ms": 1e3 * float(np.median([r["ttft_s"]["p50"] for r in runs[p]])),
            "ttft_p99_ms": 1e3 * float(np.median([r["ttft_s"]["p99"] for r in runs[p]])),
            "tokens_per_s": float(np.median([r["tokens_per_s"] for r in runs[p]])),
            "batch_tokens_per_s": float(np.median([r["batch_tokens_per_s"] for r in runs[p]])),
        }
    ratio = summary["priority"]["ttft_p50_ms"] / summary["fcfs"]["ttft_p50_ms"]
    change = summary["priority"]["tokens_per_s"] / summary["fcfs"]["tokens_per_s"] - 1
    print_table("interactive (priority -1) TTFT and batch throughput",
                ["policy", "interactive TTFT p50 ms", "p99 ms", "all tok/s", "flood tok/s"],
                [[p, f"{s['ttft_p50_ms']:.1f}", f"{s['ttft_p99_ms']:.1f}", f"{s['tokens_per_s']:.0f}",
                  f"{s['batch_tokens_per_s']:.0f}"]
                 for p, s in summary.items()])
    met = ratio <= TARGETS["ttft_p50_ratio"] and abs(change) <= TARGETS["throughput_within"]
    print(f"TTFT p50 priority/fcfs: {ratio:.3f} (target <= 0.333); throughput change: {change:+.1%} "
          f"(target within 10%): {'met' if met else 'NOT met'}")
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": machine_info(), "summary": summary,
                               "ttft_p50_ratio": ratio, "throughput_change": change, "targets": TARGETS,
                               "met": met, "runs": runs})
    return 0

