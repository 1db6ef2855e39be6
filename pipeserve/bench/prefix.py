"""`pipeserve bench prefix`: prefix caching on vs off, in process, on stories260K and the ~20M random
Llama (LLAMA_20M), in one run.

Workloads (synthetic token ids, greedy, ignore_eos; every repetition draws fresh ids where noted):
- shared: --requests requests submitted together, each a --system-len token system prompt shared by
  all of them (the same in every repetition) and a fresh --user-len token user turn; --output-len
  tokens each.
- chat: --chats multi-turn conversations of --turns turns, fresh every repetition; turn k resends
  the whole history (every earlier user turn and answer) plus a new --user-len token user turn. The
  conversations' turns are submitted together, turn after turn.
- unique: --requests prompts of system-len + user-len fresh ids: nothing to share (the cache's cost).

Each model gets two engines, cache on and cache off, alternated within each repetition (which goes
first alternates too), after one unmeasured warm-up repetition of every workload on each (which
also puts the system prompt in the cache, as serving traffic would have). Figures are medians over
--repeats. TTFT: submission to first token. Throughput: prompt + generated tokens per second of the
workload's wall time; "x paired" is the median over repetitions of on / off of each adjacent pair,
and "sched +%" the host time the cache adds in the scheduler (matching, hashing, bookkeeping: all
that differs when nothing is shared) as a share of the cache-off wall time. Hit rate: prefix-cache
hits over queries (tokens; the engine's counters); the ideal is the fraction of prompt tokens that
are shared: for each request, the longest prefix in whole pages (never its last token) it has in
common with a prompt submitted before it or with it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.bench.metrics import stats
from pipeserve.bench.report import Panel, Series, machine_info, plot_panels, print_table, write_json
from pipeserve.bench.shapes import LLAMA_20M, random_checkpoint
from pipeserve.bench.workload import shared_dir
from pipeserve.config import EngineConfig

WORKLOADS = ("shared", "chat", "unique")
TARGETS = {"shared_ttft_x": 3.0, "shared_throughput_x": 2.0, "hit_rate_of_ideal": 0.9, "unique_within": 0.02}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=["stories260K", "llama-20m"],
                        help="stories260K (the shared assets), llama-20m (random weights) or checkpoint dirs")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                        help="shared: one system prompt; chat: growing histories; unique: no sharing")
    parser.add_argument("--requests", type=int, default=32, help="shared: requests submitted together")
    parser.add_argument("--system-len", type=int, default=384, help="shared: system prompt tokens")
    parser.add_argument("--user-len", type=int, default=32, help="tokens of each distinct user turn")
    parser.add_argument("--output-len", type=int, default=8, help="tokens generated per request")
    parser.add_argument("--chats", type=int, default=8, help="chat workload: conversations replayed")
    parser.add_argument("--turns", type=int, default=4, help="chat workload: turns per conversation")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions of cache on and off, alternated")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (the unit of sharing)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the engine's token budget per step")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--json", metavar="PATH", help="write the full results as JSON")
    parser.add_argument("--out", metavar="DIR", help="write the PNG plot into DIR")


class Prefixes:
    """The ideal hit count: every prompt an engine saw, as page-hash chains, and the shared pages of
    each new prompt."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.seen: set[tuple[int, ...]] = set()

    def shared_tokens(self, batch: list[list[int]]) -> int:
        """Tokens of `batch` (submitted together) in whole pages shared with an earlier or a sibling
        prompt, each prompt's last token excluded; then remember them."""
        size, total = self.page_size, 0
        counts: dict[tuple[int, ...], int] = {}
        for prompt in batch:
            for n in range(size, len(prompt), size):
                counts[tuple(prompt[:n])] = counts.get(tuple(prompt[:n]), 0) + 1
        for prompt in batch:
            shared = 0
            for n in range(size, len(prompt), size):
                key = tuple(prompt[:n])
                if key not in self.seen and counts[key] < 2:
                    break
                shared = n
            total += shared
        for prompt in batch:
            self.seen.update(tuple(prompt[:n]) for n in range(size, len(prompt) + 1, size))
        return total


class Runner:
    """One engine and what it has seen."""

    def __init__(self, model_dir: str, on: bool, args: argparse.Namespace) -> None:
        from pipeserve.engine.engine import Engine

        self.on = on
        self.engine = Engine(EngineConfig(
            model=model_dir, device="cpu", dtype="float32", page_size=args.page_size, prefix_caching=on,
            max_num_seqs=max(args.requests, args.chats), max_num_batched_tokens=args.max_num_batched_tokens))
        self.prefixes = Prefixes(args.page_size)
        self.ids = 0
        # Host time in the scheduler (admission, prefix matching and hashing, bookkeeping): the only
        # work that differs between cache on and off when nothing is shared.
        self.scheduler_s = 0.0
        sched = self.engine.scheduler
        for name in ("schedule", "postprocess"):
            setattr(sched, name, self._timed(getattr(sched, name)))

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.scheduler_s += time.perf_counter() - start

        return timed

    def run(self, batch: list[list[int]], output_len: int) -> dict[str, Any]:
        """Submit `batch` at once, step to completion; TTFTs, wall time, cache counters, outputs."""
        from pipeserve.sampling_params import SamplingParams

        engine = self.engine
        before, sched_before = engine.stats(), self.scheduler_s
        ideal = self.prefixes.shared_tokens(batch)
        start = time.perf_counter()
        rids = []
        for prompt in batch:
            rid = f"p{self.ids}"
            self.ids += 1
            rids.append(rid)
            engine.add(rid, prompt, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0))
        first: dict[str, float] = {}
        outputs: dict[str, list[int]] = {rid: [] for rid in rids}
        while engine.has_work():
            updates = engine.step()
            now = time.perf_counter()
            for u in updates:
                if u.token_ids:
                    first.setdefault(u.rid, now - start)
                    outputs[u.rid] += u.token_ids
        wall = time.perf_counter() - start
        after = engine.stats()
        return {
            "wall_s": wall,
            "scheduler_s": self.scheduler_s - sched_before,
            "ttft_s": [first[r] for r in rids],
            "tokens": sum(map(len, batch)) + output_len * len(batch),
            "queries": after["prefix_cache_queries"] - before["prefix_cache_queries"],
            "hits": after["prefix_cache_hits"] - before["prefix_cache_hits"],
            "prompt_tokens": sum(map(len, batch)),
            "ideal": ideal,
            "outputs": [outputs[r] for r in rids],
        }


def draw(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(3, vocab, n).tolist()


def workload(runner: Runner, name: str, rng: np.random.Generator, system: list[int], vocab: int,
             args: argparse.Namespace) -> dict[str, Any]:
    """One repetition of a workload on one engine (rng: the repetition's own draw, so on and off get
    the same ids)."""
    if name == "shared":
        batch = [system + draw(rng, vocab, args.user_len) for _ in range(args.requests)]
        return runner.run(batch, args.output_len)
    if name == "unique":
        batch = [draw(rng, vocab, len(system) + args.user_len) for _ in range(args.requests)]
        return runner.run(batch, args.output_len)
    histories: list[list[int]] = [[] for _ in range(args.chats)]
    turns = []
    for _ in range(args.turns):
        batch = [h + draw(rng, vocab, args.user_len) for h in histories]
        result = runner.run(batch, args.output_len)
        histories = [p + out for p, out in zip(batch, result.pop("outputs"), strict=True)]
        turns.append(result)
    return {
        "ttft_s": [x for t in turns for x in t["ttft_s"]],
        **{k: sum(t[k] for t in turns)
           for k in ("wall_s", "scheduler_s", "tokens", "queries", "hits", "prompt_tokens", "ideal")},
    }


def figures(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repetitions."""
    return {
        "ttft_p50_ms": float(np.median([np.percentile(r["ttft_s"], 50) for r in reps])) * 1e3,
        "ttft_ms": stats([x * 1e3 for r in reps for x in r["ttft_s"]]),
        "wall_s": float(np.median([r["wall_s"] for r in reps])),
        "scheduler_s": float(np.median([r["scheduler_s"] for r in reps])),
        "tokens_per_s": float(np.median([r["tokens"] / r["wall_s"] for r in reps])),
        "hit_rate": float(np.median([r["hits"] / r["queries"] if r["queries"] else 0.0 for r in reps])),
        "ideal_rate": float(np.median([r["ideal"] / r["prompt_tokens"] for r in reps])),
    }


def resolve_model(name: str, tmp: str) -> tuple[str, str]:
    if name == "llama-20m":
        return name, random_checkpoint(LLAMA_20M, os.path.join(tmp, name))
    if name == "stories260K":
        return name, str(shared_dir() / "models" / "stories260K")
    return Path(name).name, name


def bench_model(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    runners = {True: Runner(model_dir, True, args), False: Runner(model_dir, False, args)}
    cfg = runners[True].engine.model_config
    context = runners[True].engine.max_model_len
    if max(args.system_len + args.user_len, (args.user_len + args.output_len) * args.turns) >= context:
        raise SystemExit(f"pipeserve bench prefix: a prompt and its output exceed the context ({context})")
    system = draw(np.random.default_rng(args.seed), cfg.vocab_size, args.system_len)
    names = [w for w in WORKLOADS if w in args.workloads]
    reps: dict[str, dict[bool, list[dict[str, Any]]]] = {w: {True: [], False: []} for w in names}
    for rep in range(-1, args.repeats):  # -1: the warm-up
        for name in names:
            order = (True, False) if rep % 2 == 0 else (False, True)
            for on in order:
                rng = np.random.default_rng([args.seed, rep + 1, WORKLOADS.index(name)])
                result = workload(runners[on], name, rng, system, cfg.vocab_size, args)
                result.pop("outputs", None)
                if rep >= 0:
                    reps[name][on].append(result)
    out: dict[str, Any] = {}
    for name in names:
        cached, cold = figures(reps[name][True]), figures(reps[name][False])
        out[name] = {
            "on": cached,
            "off": cold,
            "ttft_p50_x": cold["ttft_p50_ms"] / cached["ttft_p50_ms"],
            "throughput_x": cached["tokens_per_s"] / cold["tokens_per_s"],
            # On / off of each repetition's adjacent pair: steadier than a ratio of medians under load.
            "throughput_x_paired": float(np.median([
                (a["tokens"] / a["wall_s"]) / (b["tokens"] / b["wall_s"])
                for a, b in zip(reps[name][True], reps[name][False], strict=True)])),
            # The scheduler time the cache adds, as a share of the cache-off wall time.
            "scheduler_overhead": (cached["scheduler_s"] - cold["scheduler_s"]) / cold["wall_s"],
            "hit_rate_of_ideal": cached["hit_rate"] / cached["ideal_rate"] if cached["ideal_rate"] else None,
            "repetitions": {"on": reps[name][True], "off": reps[name][False]},
        }
    return out


def targets(model: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "shared" in model:
        shared = model["shared"]
        out |= {
            "shared_ttft_p50_x": shared["ttft_p50_x"],
            "shared_ttft_met": shared["ttft_p50_x"] >= TARGETS["shared_ttft_x"],
            "shared_throughput_x": shared["throughput_x"],
            "shared_throughput_met": shared["throughput_x"] >= TARGETS["shared_throughput_x"],
            "shared_hit_rate_of_ideal": shared["hit_rate_of_ideal"],
            "shared_hit_rate_met": (shared["hit_rate_of_ideal"] or 0.0) >= TARGETS["hit_rate_of_ideal"],
        }
    if "chat" in model:
        out["chat_hit_rate_of_ideal"] = model["chat"]["hit_rate_of_ideal"]
    if "unique" in model:
        unique = model["unique"]
        out |= {
            "unique_throughput_x": unique["throughput_x"],
            "unique_throughput_x_paired": unique["throughput_x_paired"],
            "unique_scheduler_overhead": unique["scheduler_overhead"],
            "unique_met": unique["throughput_x_paired"] >= 1 - TARGETS["unique_within"],
        }
    return out


def plot(result: dict[str, Any], path: Path) -> Path:
    names = result["config"]["workloads"]
    xs = list(range(len(names)))
    ttft = Panel("TTFT p50 (ms)", xlabel=" / ".join(f"{i}: {w}" for i, w in enumerate(names)),
                 logy=True, title="time to first token")
    tput = Panel("tokens / s", xlabel=ttft.xlabel, logy=True, title="throughput (prompt + generated)")
    for i, (name, model) in enumerate(result["models"].items()):
        for mode, style in (("on", "-"), ("off", "--")):
            label = f"{name}, cache {mode}"
            ttft.series.append(Series(label, xs, [model[w][mode]["ttft_p50_ms"] for w in names],
                                      color=f"C{i}", linestyle=style))
            tput.series.append(Series(label, xs, [model[w][mode]["tokens_per_s"] for w in names],
                                      color=f"C{i}", linestyle=style))
    return plot_panels(path, [ttft, tput], title="prefix caching on vs off (medians)")


def main(args: argparse.Namespace) -> int:
    if min(args.requests, args.chats, args.turns, args.repeats, args.user_len, args.output_len) < 1:
        raise SystemExit("pipeserve bench prefix: counts and lengths must be >= 1")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "bench": "prefix",
        "machine": machine_info(),
        "loadavg_start": os.getloadavg(),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "out")},
        "targets": TARGETS,
        "models": {},
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            name, model_dir = resolve_model(model, tmp)
            figures_ = result["models"][name] = bench_model(model_dir, args)
            figures_["targets"] = targets(figures_)
            for w in args.workloads:
                f = figures_[w]
                rows.append([name, w, f["off"]["ttft_p50_ms"], f["on"]["ttft_p50_ms"], f["ttft_p50_x"],
                             f["off"]["tokens_per_s"], f["on"]["tokens_per_s"], f["throughput_x"],
                             f["throughput_x_paired"], 100 * f["scheduler_overhead"],
                             f["on"]["hit_rate"], f["on"]["ideal_rate"]])
    result["loadavg_end"] = os.getloadavg()
    print_table(
        f"prefix caching, medians of {args.repeats} (load {result['loadavg_start'][0]:.2f} -> "
        f"{result['loadavg_end'][0]:.2f})",
        ["model", "workload", "TTFT p50 off ms", "on ms", "x lower", "tok/s off", "tok/s on", "x",
         "x paired", "sched +%", "hit rate", "ideal"],
        rows,
    )
    for name, model in result["models"].items():
        print(name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in model["targets"].items()})
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    if args.out:
        print(f"wrote {plot(result, Path(args.out) / 'prefix.png')}")
    return 0
