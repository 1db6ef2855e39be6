"""`pipeserve bench pipeline`: what the process pipeline costs, and what it can carry.

Part 1, pipeline vs in-process, on a ~20M-parameter random Llama (pipeserve/bench/shapes.py's
LLAMA_20M_BYTES: a byte-level tokenizer, since the detokenizer needs one: vocab 259, so 7 layers
instead of 6 keep it at ~20M) that is engine-bound on a CPU:
- throughput: the same requests (random prompts of --input-len, greedy, ignore_eos, --output-len
  tokens each), all sent at once, run (a) in this process through Engine.step() and (b) through
  gateway + tokenizers + engine + detokenizer (pipeserve.launcher's processes) by --concurrency
  streaming gRPC clients of pipeserve/bench/serve.py. Output tokens/s both ways and their ratio.
- added TTFT at low load: --ttft-requests requests one after another, both ways; the added TTFT
  is the difference of the medians.
Part 2, gateway capacity: the engine process is replaced by SyntheticEngine (this module, a
benchmark mode only) inside the real EngineLoop: it echoes each prompt's ids as its output, one
token per running request per step, stepping as fast as the detokenizer takes the steps (ZeroMQ's
high-water mark blocks the send). With --capacity-streams concurrent streams of
--capacity-output-len tokens, the client-side output tokens/s is what the detokenizer, the gateway
and the gRPC clients sustain together; tokens per streamed message shows the gateway coalescing.

Times are the client's (pipeserve/bench/metrics.py); both parts also record the load average,
since this machine is shared. Every figure is printed; --json writes them, --out a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.bench.metrics import RequestRecord, summarize
from pipeserve.bench.report import (
    Panel,
    Series,
    cdf_series,
    machine_info,
    plot_panels,
    print_table,
    write_json,
)
from pipeserve.bench.serve import Outcome, Planned, send
from pipeserve.bench.shapes import LLAMA_20M_BYTES, random_checkpoint
from pipeserve.config import Addresses, EngineConfig, GatewayConfig, InternalAuth
from pipeserve.cpus import CpuSplit, cpu_split
from pipeserve.engine.sequence import Sequence, StepUpdate
from pipeserve.local_cluster import free_port
from pipeserve.lora import LoRARequest
from pipeserve.sampling_params import SamplingParams
from pipeserve.zmq_auth import InternalSockets

TEXT = "the quick brown fox jumps over the lazy dog; "  # ASCII: one byte token per character


# ---- the synthetic token source (part 2) --------------------------------------------------------
@dataclass
class _Seq:
    rid: str
    prompt: list[int]
    max_tokens: int
    produced: int = 0
    announced: bool = False
    finish: str = ""
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class SyntheticEngine:
    """Engine's loop-facing interface (add, abort, has_work, step, stats, model_info, step_count,
    config) with no model: each step gives every running request its next token, the prompt's ids
    repeated, until max_tokens. Requests are admitted at once, without a limit."""

    info: dict[str, Any]
    config: EngineConfig = field(default_factory=EngineConfig)
    step_count: int = 0
    running: dict[str, _Seq] = field(default_factory=dict)
    ended: list[_Seq] = field(default_factory=list)

    def model_info(self) -> dict[str, Any]:
        return dict(self.info)

    def add(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        app: str = "",
        arrival: float | None = None,
        cache_salt: str = "",
        embed: bool = False,
        lora: LoRARequest | None = None,
    ) -> None:
        if embed or lora is not None:  # it has no hidden states and no adapters: refuse, never fake
            raise ValueError("the synthetic engine serves plain generation only (no embeddings, no LoRA)")
        if rid in self.running:
            raise ValueError(f"request_id {rid!r} is already in flight")
        if not prompt_ids:
            raise ValueError("prompt is empty")
        self.running[rid] = _Seq(rid, list(prompt_ids), params.max_tokens or 16, params=params)

    def take_refused(self) -> dict[str, str]:
        return {}  # it compiles no constraint

    def capacity_problem(self, prompt_len: int) -> str | None:
        return None  # no context, no pool

    def abort(self, rid: str, reason: str = "abort") -> bool:
        seq = self.running.pop(rid, None)
        if seq is not None:
            seq.finish = reason
            self.ended.append(seq)
        return seq is not None or any(s.rid == rid for s in self.ended)

    def has_work(self) -> bool:
        return bool(self.running or self.ended)

    def step(self) -> list[StepUpdate]:
        rows = list(self.running.values())
        tokens = []
        for seq in rows:
            tokens.append([seq.prompt[seq.produced % len(seq.prompt)]])
            seq.produced += 1
            if seq.produced >= seq.max_tokens:
                seq.finish = "length"
                del self.running[seq.rid]
        rows += self.ended
        tokens += [[] for _ in self.ended]
        self.ended = []
        updates = []
        for seq, ids in zip(rows, tokens, strict=True):
            request = Sequence(seq.rid, seq.prompt, len(seq.prompt), seq.params, 0.0)
            updates.append(StepUpdate(request, ids, seq.finish, None, not seq.announced))
            seq.announced = True
        self.step_count += 1
        return updates

    def stats(self) -> dict[str, int]:
        return {
            "running": len(self.running),
            "waiting": 0,
            "pages_total": 0,
            "pages_used": 0,
            "pages_reserved": 0,
            "preemptions": 0,
            "requests": len(self.running),
            "steps": self.step_count,
        }


def serve_synthetic(model_dir: str) -> int:
    """The engine process of part 2: EngineLoop around a SyntheticEngine, on the launcher's sockets."""
    import zmq

    from pipeserve.engine.process import EngineLoop
    from pipeserve.tokenizer.load import model_limits

    limits = model_limits(model_dir)
    info = {
        "name": "synthetic",
        "context_length": limits.context_len,
        "vocab_size": limits.vocab_size,
        "eos_token_ids": [],
        "dtype": "none",
        "device": "none",
        "backend": "synthetic",
    }
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    addrs, ctx = Addresses(), zmq.Context()
    internal = InternalSockets(ctx, InternalAuth(), "synthetic engine")
    requests, control, steps, errors, status = (
        ctx.socket(t) for t in (zmq.PULL, zmq.PULL, zmq.PUSH, zmq.PUSH, zmq.PUSH)
    )
    try:
        internal.bind(requests, addrs.requests)
        internal.bind(control, addrs.control)
        for sock, endpoint in ((steps, addrs.steps), (errors, addrs.errors), (status, addrs.status)):
            internal.connect(sock, endpoint)
        loop = EngineLoop(SyntheticEngine(info), requests, control, steps, errors, status)
        loop.more_stats = internal.stats
        loop.run(lambda: bool(stopping))
    finally:
        internal.close()
        ctx.destroy(linger=500)
    return 0


# ---- the pipeline's processes -------------------------------------------------------------------
@contextlib.contextmanager
def pipeline(engine: EngineConfig, workers: int, synthetic: bool, timeout: float = 300.0,
             http_port: int | None = None, zmq_over: str = "ipc") -> Iterator[str]:
    """Start the launcher's processes (the engine or the synthetic one); yield the gRPC target.
    http_port: the gateway serves the OpenAI HTTP API there too. zmq_over: as `up --zmq-over`."""
    from pipeserve.launcher import running

    gateway = GatewayConfig(port=free_port(), grace=1.0, http_port=http_port)
    engine_argv = ["bench", "pipeline", "--serve-synthetic", str(engine.model)] if synthetic else None
    with running(engine, gateway, workers, timeout, [], engine_argv=engine_argv, zmq_over=zmq_over) as up:
        if not up.serving:
            raise RuntimeError("the pipeline did not become SERVING")
        yield up.target


async def streams(
    target: str, prompts: list[list[int]], output_len: int, sequential: bool = False
) -> tuple[list[Outcome], float]:
    """Send every prompt (all at once, or one after another); the outcomes and the run's duration."""
    from pipeserve.gateway.client import AsyncClient

    async with AsyncClient(target) as client:
        await client.wait_ready(60.0)
        work = [Planned(0.0, len(p), output_len, "bench") for p in prompts]
        start = time.perf_counter()
        if sequential:
            outcomes = [await send(client, w, p, 120.0) for w, p in zip(work, prompts, strict=True)]
        else:
            tasks = [send(client, w, p, 300.0) for w, p in zip(work, prompts, strict=True)]
            outcomes = list(await asyncio.gather(*tasks))
    end = max(
        (o.record.chunk_times[-1] for o in outcomes if o.record.chunk_times), default=time.perf_counter()
    )
    return outcomes, end - start


def checked(outcomes: list[Outcome], what: str) -> list[RequestRecord]:
    errors = sorted({o.record.error for o in outcomes if o.record.error})
    if errors:
        raise RuntimeError(f"{what}: {len(errors)} kinds of error, e.g. {errors[0]}")
    return [o.record for o in outcomes]


# ---- part 1: in-process -------------------------------------------------------------------------
def run_in_process(
    engine: Any, prompts: list[list[int]], output_len: int, tag: str
) -> tuple[list[RequestRecord], float]:
    """Add every prompt at t=0 and step to the end; one RequestRecord per request, chunk = step output."""
    start = time.perf_counter()
    records: dict[str, RequestRecord] = {}
    for i, prompt in enumerate(prompts):
        rid = f"{tag}-{i}"
        records[rid] = RequestRecord(time.perf_counter(), prompt_tokens=len(prompt))
        engine.add(rid, prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    while engine.has_work():
        updates = engine.step()
        now = time.perf_counter()
        for update in updates:
            records[update.rid].add_chunk(now, len(update.token_ids))
    end = max(r.chunk_times[-1] for r in records.values())
    return list(records.values()), end - start


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    return LLAMA_20M_BYTES | {"num_hidden_layers": args.num_layers}


def parameters(model_dir: str) -> int:
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), "np") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())  # noqa: SIM118


@dataclass
class Cores:
    """Where this process runs: in-process runs anywhere; as the pipeline's client, on the cores the
    launcher left to the gateway and workers (pipeserve/cpus.py), so it does not preempt the engine
    (clients of a deployed server run elsewhere)."""

    split: CpuSplit | None
    everything: set[int] = field(default_factory=lambda: os.sched_getaffinity(0))

    def in_process(self) -> None:
        os.sched_setaffinity(0, self.everything)

    def client(self) -> None:
        if self.split is not None:
            os.sched_setaffinity(0, set(self.split.others))


async def ttft_interleaved(
    engine: Any, target: str, prompts: list[list[int]], output_len: int, cores: Cores
) -> tuple[list[RequestRecord], list[RequestRecord]]:
    """One request at a time, alternately in-process and through the pipeline (the same load for both)."""
    from pipeserve.gateway.client import AsyncClient

    local, remote = [], []
    async with AsyncClient(target) as client:
        await client.wait_ready(60.0)
        for i, prompt in enumerate(prompts):
            cores.in_process()
            local += run_in_process(engine, [prompt], output_len, f"ttft-{i}")[0]
            cores.client()
            remote.append(await send(client, Planned(0.0, len(prompt), output_len, "ttft"), prompt, 120.0))
    cores.in_process()
    return local, checked(remote, "pipeline TTFT run")


def part1(args: argparse.Namespace, model_dir: str, load: dict[str, Any]) -> dict[str, Any]:
    """--rounds of (in-process run, pipeline run), alternated so that both see the same machine load."""
    import torch

    from pipeserve.engine.engine import Engine
    from pipeserve.engine.process import engine_threads

    config = EngineConfig(model=model_dir, device="cpu", dtype="float32", max_num_seqs=args.concurrency)
    # In-process runs with the threads the engine process takes for this config: the same engine.
    threads = engine_threads(config)
    torch.set_num_threads(threads)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, 259, args.input_len).tolist() for _ in range(args.requests)]
    ttft_prompts = [rng.integers(3, 259, args.input_len).tolist() for _ in range(args.ttft_requests)]
    engine = Engine(config)
    info = engine.model_info()
    local: list[RequestRecord] = []
    remote: list[RequestRecord] = []
    rounds, local_s, remote_s = [], 0.0, 0.0
    cores = Cores(cpu_split(config))
    with pipeline(config, args.tokenizer_workers, synthetic=False) as target:
        run_in_process(engine, prompts[:2], 4, "warmup")
        asyncio.run(streams(target, prompts[:2], 4))
        for i in range(args.rounds):
            load[f"round_{i}"] = os.getloadavg()
            cores.in_process()
            records, seconds = run_in_process(engine, prompts, args.output_len, f"run-{i}")
            cores.client()
            outcomes, duration = asyncio.run(streams(target, prompts, args.output_len))
            cores.in_process()
            local, local_s = local + records, local_s + seconds
            remote, remote_s = remote + checked(outcomes, "pipeline run"), remote_s + duration
            a = sum(r.output_tokens for r in records) / seconds
            b = sum(r.output_tokens for r in remote[-len(prompts) :]) / duration
            rounds.append({"in_process_tokens_per_s": a, "pipeline_tokens_per_s": b, "ratio": b / a})
        load["ttft"] = os.getloadavg()
        local_ttft, remote_ttft = asyncio.run(
            ttft_interleaved(engine, target, ttft_prompts, args.ttft_output_len, cores)
        )
    s_local, s_remote = summarize(local, local_s), summarize(remote, remote_s)
    t_local = [r.ttft for r in local_ttft]
    t_remote = [r.ttft for r in remote_ttft]
    added = statistics.median(t_remote) - statistics.median(t_local)
    ratio = s_remote["output_throughput"] / s_local["output_throughput"]
    return {
        "model": {"config": model_config(args), "parameters": parameters(model_dir), "info": info},
        "workload": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "rounds": args.rounds,
            "ttft_requests": args.ttft_requests,
            "ttft_output_len": args.ttft_output_len,
            "engine_threads": threads,
            "engine_cores": None if cores.split is None else list(cores.split.engine),
            "client_cores": None if cores.split is None else list(cores.split.others),
        },
        "in_process": s_local,  # every round together: total tokens / total time
        "pipeline": s_remote,
        "rounds": rounds,
        "throughput_ratio": ratio,
        "ttft_low_load": {
            "in_process_s": t_local,
            "pipeline_s": t_remote,
            "in_process_p50_s": statistics.median(t_local),
            "pipeline_p50_s": statistics.median(t_remote),
            "added_p50_s": added,
        },
        "targets": {"throughput_ratio": 0.9, "added_ttft_p50_s": 0.005},
        "met": {"throughput_ratio": ratio >= 0.9, "added_ttft_p50": added <= 0.005},
    }


# ---- part 2: capacity ---------------------------------------------------------------------------
def part2(args: argparse.Namespace, model_dir: str, load: dict[str, Any]) -> dict[str, Any]:
    from pipeserve.tokenizer.load import load_tokenizer

    prompt = load_tokenizer(model_dir).encode(TEXT, add_special_tokens=False)
    config = EngineConfig(model=model_dir, device="cpu")
    rows = []
    with pipeline(config, args.tokenizer_workers, synthetic=True, zmq_over=args.zmq_over) as target:
        asyncio.run(streams(target, [prompt] * 4, 16))  # warm-up
        for n in args.capacity_streams:
            load[f"capacity_{n}"] = os.getloadavg()
            outcomes, duration = asyncio.run(streams(target, [prompt] * n, args.capacity_output_len))
            records = checked(outcomes, f"capacity run with {n} streams")
            s = summarize(records, duration)
            messages = sum(o.chunks for o in outcomes)
            rows.append(
                {
                    "streams": n,
                    "output_tokens": s["output_tokens"],
                    "duration_s": duration,
                    "tokens_per_s": s["output_throughput"],
                    "messages": messages,
                    "tokens_per_message": s["output_tokens"] / messages,
                    "summary": s,
                }
            )
    best = max(rows, key=lambda r: r["tokens_per_s"])
    at_max = max(rows, key=lambda r: r["streams"])
    return {
        "output_len": args.capacity_output_len,
        "runs": rows,
        "best_tokens_per_s": best["tokens_per_s"],
        "max_streams": at_max["streams"],
        "tokens_per_s_at_max_streams": at_max["tokens_per_s"],
        "target_tokens_per_s": 20000.0,
        "met": at_max["tokens_per_s"] >= 20000.0,
    }


# ---- output -------------------------------------------------------------------------------------
def print_result(result: dict[str, Any]) -> None:
    p1, p2 = result.get("part1"), result.get("part2")
    if p1:
        rows = []
        for name in ("in_process", "pipeline"):
            s = p1[name]
            rows.append(
                [
                    name,
                    s["completed"],
                    s["output_tokens"],
                    s["duration_s"],
                    s["output_throughput"],
                    s["ttft_s"]["p50"] * 1e3,
                    s["tpot_s"]["p50"] * 1e3,
                ]
            )
        w = p1["workload"]
        print_table(
            f"part 1: {w['requests']} requests x {w['output_len']} tokens, {w['concurrency']} concurrent, "
            f"{p1['model']['parameters'] or '?'} params",
            ["run", "completed", "output tokens", "duration s", "tokens/s", "TTFT p50 ms", "TPOT p50 ms"],
            rows,
        )
        print_table(
            "part 1: rounds (in-process and pipeline alternated)",
            ["round", "in-process tokens/s", "pipeline tokens/s", "ratio"],
            [
                [i, r["in_process_tokens_per_s"], r["pipeline_tokens_per_s"], r["ratio"]]
                for i, r in enumerate(p1["rounds"])
            ],
        )
        t = p1["ttft_low_load"]
        print_table(
            "part 1: against the targets",
            ["figure", "value", "target", "met"],
            [
                [
                    "pipeline / in-process tokens/s",
                    p1["throughput_ratio"],
                    ">= 0.9",
                    p1["met"]["throughput_ratio"],
                ],
                ["in-process TTFT p50 ms (1 at a time)", t["in_process_p50_s"] * 1e3, "", None],
                ["pipeline TTFT p50 ms (1 at a time)", t["pipeline_p50_s"] * 1e3, "", None],
                ["added TTFT p50 ms", t["added_p50_s"] * 1e3, "<= 5", p1["met"]["added_ttft_p50"]],
            ],
        )
    if p2:
        print_table(
            f"part 2: synthetic engine, {p2['output_len']} tokens per stream",
            [
                "streams",
                "output tokens",
                "duration s",
                "tokens/s",
                "messages",
                "tokens/message",
                "TTFT p50 ms",
                "ITL p50 ms",
            ],
            [
                [
                    r["streams"],
                    r["output_tokens"],
                    r["duration_s"],
                    r["tokens_per_s"],
                    r["messages"],
                    r["tokens_per_message"],
                    r["summary"]["ttft_s"]["p50"] * 1e3,
                    (r["summary"]["itl_s"]["p50"] or 0.0) * 1e3,
                ]
                for r in p2["runs"]
            ],
            caption=f"at {p2['max_streams']} streams {p2['tokens_per_s_at_max_streams']:,.0f} tokens/s "
            f"(target >= 20,000: {'met' if p2['met'] else 'NOT met'})",
        )
    load = result["machine"]["load_average"]
    print(
        "load average (1, 5, 15 min): "
        + "; ".join(f"{k} {v[0]:.2f} {v[1]:.2f} {v[2]:.2f}" for k, v in load.items())
    )


def plot(result: dict[str, Any], path: Path) -> Path:
    panels = []
    if p1 := result.get("part1"):
        t = p1["ttft_low_load"]
        ttft = Panel("fraction of requests", xlabel="TTFT, ms", title="TTFT at low load (1 at a time)")
        ttft.series = [
            cdf_series("in-process", [v * 1e3 for v in t["in_process_s"]], color="C0"),
            cdf_series("pipeline", [v * 1e3 for v in t["pipeline_s"]], color="C1"),
        ]
        xs = list(range(len(p1["rounds"])))
        tput = Panel(
            "output tokens/s", xlabel="round", title=f"throughput (ratio {p1['throughput_ratio']:.3f})"
        )
        tput.series = [
            Series("in-process", xs, [r["in_process_tokens_per_s"] for r in p1["rounds"]], color="C0"),
            Series("pipeline", xs, [r["pipeline_tokens_per_s"] for r in p1["rounds"]], color="C1"),
        ]
        panels += [tput, ttft]
    if p2 := result.get("part2"):
        xs = [r["streams"] for r in p2["runs"]]
        cap = Panel("streamed tokens/s", xlabel="concurrent streams", title="gateway capacity", logx=True)
        cap.series = [
            Series("synthetic engine", xs, [r["tokens_per_s"] for r in p2["runs"]], color="C2"),
            Series("target 20k", [min(xs), max(xs)], [20000, 20000], color="k", linestyle=":", marker=None),
        ]
        panels.append(cap)
    return plot_panels(path, panels, title="pipeserve bench pipeline")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=32, help="part 1: requests, all sent at once")
    parser.add_argument("--concurrency", type=int, default=32, help="part 1: max_num_seqs of the engine")
    parser.add_argument("--input-len", type=int, default=32, help="part 1: prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="part 1: output tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="part 1: alternated in-process/pipeline runs")
    parser.add_argument("--ttft-requests", type=int, default=50, help="part 1: sequential requests for TTFT")
    parser.add_argument("--ttft-output-len", type=int, default=4, help="part 1: their output tokens")
    parser.add_argument(
        "--capacity-streams",
        type=int,
        nargs="+",
        default=[1, 16, 64, 256],
        help="part 2: concurrent streams, one run each",
    )
    parser.add_argument("--capacity-output-len", type=int, default=900, help="part 2: tokens per stream")
    parser.add_argument(
        "--num-layers",
        type=int,
        default=LLAMA_20M_BYTES["num_hidden_layers"],
        help="part 1: layers of the random Llama (fewer: a smaller model, for quick checks)",
    )
    parser.add_argument("--tokenizer-workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--skip-part1", action="store_true", help="only the capacity run")
    parser.add_argument("--zmq-over", default="ipc", choices=("ipc", "tcp", "tcp-insecure"),
                        help="part 2: the processes' transport, as `up --zmq-over` (tcp: with CURVE, "
                             "tcp-insecure: without; alternate them to measure what CURVE costs)")
    parser.add_argument("--skip-part2", action="store_true", help="only pipeline vs in-process")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--out", metavar="DIR", help="write pipeline.png into DIR")
    # The engine process of part 2, started by this command itself through the launcher.
    parser.add_argument("--serve-synthetic", metavar="MODEL_DIR", help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    if args.serve_synthetic:
        return serve_synthetic(args.serve_synthetic)
    logging.basicConfig(level=logging.WARNING)
    from pipeserve.demo import save_byte_tokenizer

    load: dict[str, Any] = {"start": os.getloadavg()}
    result: dict[str, Any] = {"bench": "pipeline"}
    with tempfile.TemporaryDirectory(prefix="pipeserve-llama20m-") as model_dir:
        if args.skip_part1:  # part 2 reads only the config and the tokenizer
            write_json(os.path.join(model_dir, "config.json"), model_config(args))
        else:
            random_checkpoint(model_config(args), model_dir, args.seed)
        save_byte_tokenizer(model_dir, LLAMA_20M_BYTES["max_position_embeddings"])
        if not args.skip_part1:
            result["part1"] = part1(args, model_dir, load)
        if not args.skip_part2:
            result["part2"] = part2(args, model_dir, load)
    load["end"] = os.getloadavg()
    result["machine"] = {**machine_info(), "load_average": load}
    print_result(result)
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    if args.out:
        print(f"wrote {plot(result, Path(args.out) / 'pipeline.png')}")
    return 0
