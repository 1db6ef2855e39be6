"""`pipeserve bench serve`: streaming clients against a running gateway (`pipeserve up`): gRPC, or
with --api openai the OpenAI-compatible HTTP API (`/v1/completions`, server-sent events).

Workload, one of:
- a trace replay (default): the shared traces (or --trace files) at their real arrival times
  divided by --rate-scale, prompt and output lengths scaled to the served model's context
  (pipeserve/bench/workload.py);
- --rate R: gamma arrivals at R requests/s (Poisson at --burstiness 1), lengths from the traces in
  order, or fixed with --input-len and --output-len.
--num-requests and --duration cut the workload. Every request is synthetic prompt_token_ids of its
prompt length, greedy, ignore_eos, max_tokens = its output length, sent at its arrival time whatever
is still in flight (an open loop). The metrics are those of pipeserve/bench/metrics.py, from this
client's clock; the JSON fields are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
from tqdm import tqdm

from pipeserve.bench.metrics import SLO, RequestRecord, summarize
from pipeserve.bench.report import (
    Panel,
    Series,
    cdf_series,
    machine_info,
    plot_panels,
    print_table,
    write_json,
)
from pipeserve.bench.workload import default_trace_paths, gamma_arrivals, load_trace, trace_paths
from pipeserve.gateway.client import DEFAULT_TARGET, AsyncClient


@dataclass(frozen=True)
class Planned:
    """One request of the workload."""

    arrival: float  # s after the first send
    prompt_tokens: int
    output_tokens: int
    app: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET, help="gateway host:port")
    parser.add_argument("--api", choices=("grpc", "openai"), default="grpc",
                        help="the front end to drive: gRPC, or the OpenAI HTTP API at --http-url")
    parser.add_argument("--http-url", default="http://127.0.0.1:8000", help="the HTTP API's base URL")
    parser.add_argument("--trace", nargs="+", metavar="CSV",
                        help="trace files (default: every CSV in $PIPESERVE_SHARED/data/traces)")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="replay the trace this many times faster")
    parser.add_argument("--rate", type=float, default=None,
                        help="requests/s, gamma arrivals instead of the trace's times ('inf': all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, < 1 burstier")
    parser.add_argument("--input-len", type=int, default=None, help="fixed prompt tokens (with --rate)")
    parser.add_argument("--output-len", type=int, default=None, help="fixed output tokens (with --rate)")
    parser.add_argument("--num-requests", type=int, default=100, help="at most this many requests")
    parser.add_argument("--duration", type=float, default=None, help="only requests arriving before this, s")
    parser.add_argument("--slo-ttft", type=float, default=SLO.ttft, help="goodput SLO on TTFT, s")
    parser.add_argument("--slo-tpot", type=float, default=SLO.tpot, help="goodput SLO on TPOT, s")
    parser.add_argument("--timeout", type=float, default=None, help="per-request deadline, s")
    parser.add_argument("--ready-timeout", type=float, default=60.0, help="wait this long for SERVING, s")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrivals and synthetic prompts")
    parser.add_argument("--json", metavar="PATH", help="write the full results as JSON")
    parser.add_argument("--out", metavar="DIR", help="write the PNG plots into DIR")  # fmt: skip


def plan(args: argparse.Namespace, context: int) -> list[Planned]:
    """The workload for a model of `context` tokens, sorted by arrival."""
    fixed = args.input_len is not None or args.output_len is not None
    if fixed:
        if args.input_len is None or args.output_len is None or args.rate is None:
            raise ValueError("--input-len and --output-len go together, with --rate")
        if min(args.input_len, args.output_len) < 1 or args.input_len + args.output_len > context:
            raise ValueError(f"--input-len + --output-len must be in [2, {context}] (the model's context)")
        lengths = [(args.input_len, args.output_len, "fixed")] * args.num_requests
    else:
        paths = trace_paths(args.trace, "pipeserve bench serve")
        window = None if args.rate is not None else args.duration
        trace = load_trace(paths, context, args.rate_scale, window, args.num_requests)
        lengths = [(r.prompt_tokens, r.output_tokens, r.app) for r in trace]
        if args.rate is None:
            return [Planned(r.arrival, r.prompt_tokens, r.output_tokens, r.app) for r in trace]
    arrivals = gamma_arrivals(len(lengths), args.rate, args.burstiness, args.seed)
    out = [Planned(t, p, o, app) for t, (p, o, app) in zip(arrivals, lengths, strict=True)]
    return [r for r in out if args.duration is None or r.arrival < args.duration]


@dataclass
class Outcome:
    """What the client saw of one request, beyond its RequestRecord."""

    planned: Planned
    record: RequestRecord
    finish_reason: str = ""
    chunks: int = 0


async def send(client: AsyncClient, planned: Planned, prompt: list[int], timeout: float | None) -> Outcome:
    record = RequestRecord(time.perf_counter(), prompt_tokens=planned.prompt_tokens, app=planned.app)
    outcome = Outcome(planned, record)
    call = client.stream(prompt, timeout=timeout, max_tokens=planned.output_tokens, ignore_eos=True,
                         temperature=0.0, app=planned.app)  # fmt: skip
    try:
        async for response in call:
            record.add_chunk(time.perf_counter(), len(response.token_ids))
            outcome.chunks += 1
            outcome.finish_reason = response.finish_reason or outcome.finish_reason
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    if record.error is None and record.output_tokens != planned.output_tokens:
        record.error = f"got {record.output_tokens} tokens, asked for {planned.output_tokens}"
    return outcome


async def send_openai(session: aiohttp.ClientSession, planned: Planned, prompt: list[int],
                      timeout: float | None) -> Outcome:
    """send() through the OpenAI HTTP API: one streamed /v1/completions, tokens counted by the ids
    each event carries (return_token_ids)."""
    record = RequestRecord(time.perf_counter(), prompt_tokens=planned.prompt_tokens, app=planned.app)
    outcome = Outcome(planned, record)
    body = {"prompt": prompt, "max_tokens": planned.output_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "return_token_ids": True}
    try:
        async with session.post("/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            else:
                async for line in response.content:  # one SSE line at a time
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        record.error = event["error"]["message"]
                        break
                    choice = event["choices"][0]
                    record.add_chunk(time.perf_counter(), len(choice["token_ids"]))
                    outcome.chunks += 1
                    outcome.finish_reason = choice["finish_reason"] or outcome.finish_reason
    except (aiohttp.ClientError, TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    if record.error is None and record.output_tokens != planned.output_tokens:
        record.error = f"got {record.output_tokens} tokens, asked for {planned.output_tokens}"
    return outcome


def http_session(url: str) -> aiohttp.ClientSession:
    """The HTTP client of the OpenAI API runs: aiohttp (as vLLM's benchmark), no connection limit."""
    return aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None))


@contextlib.asynccontextmanager
async def front_end(
    args: argparse.Namespace,
) -> AsyncIterator[tuple[Callable[..., Coroutine[Any, Any, Outcome]], Any]]:
    """(send, model info) for --api: the gRPC client, or an HTTP client of the same server."""
    async with AsyncClient(args.target) as client:
        await client.wait_ready(args.ready_timeout)
        info = await client.model_info()
        if args.api == "grpc":
            yield functools.partial(send, client), info
            return
        async with http_session(args.http_url) as http:
            yield functools.partial(send_openai, http), info


async def replay(args: argparse.Namespace) -> tuple[dict[str, Any], list[Outcome], float]:
    """Run the workload; returns the server's model info, the outcomes and the duration."""
    async with front_end(args) as (send_one, info):
        server = {"target": args.target if args.api == "grpc" else args.http_url, "api": args.api,
                  "name": info.name, "context_length": info.context_length,
                  "vocab_size": info.vocab_size, "dtype": info.dtype, "device": info.device}  # fmt: skip
        work = plan(args, info.context_length)
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(0, info.vocab_size, size=r.prompt_tokens).tolist() for r in work]
        bar = tqdm(total=len(work), desc="requests", unit="req")
        tasks: list[asyncio.Task[Outcome]] = []
        start = time.perf_counter()
        for planned, prompt in zip(work, prompts, strict=True):
            delay = start + planned.arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send_one(planned, prompt, args.timeout))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
        outcomes = list(await asyncio.gather(*tasks))
        bar.close()
    # The run lasts from the first send to the last streamed chunk (metrics.py).
    ends = [o.record.chunk_times[-1] for o in outcomes if o.record.chunk_times]
    last = max(ends, default=time.perf_counter())
    return server, outcomes, last - start


def request_json(o: Outcome, start: float) -> dict[str, Any]:
    r, p = o.record, o.planned
    return {
        "app": p.app,
        "arrival_s": p.arrival,
        "send_s": r.send_time - start,
        "prompt_tokens": p.prompt_tokens,
        "max_tokens": p.output_tokens,
        "output_tokens": r.output_tokens,
        "chunks": o.chunks,
        "ttft_s": r.ttft if r.ok else None,
        "tpot_s": r.tpot if r.ok else None,
        "e2e_s": r.e2e if r.ok else None,
        "finish_reason": o.finish_reason,
        "error": r.error,
    }


def plot(result: dict[str, Any], path: Path) -> Path:
    """CDFs of TTFT, TPOT and e2e per application (and all together), with the SLOs drawn in."""
    requests = [r for r in result["requests"] if r["error"] is None]
    apps = sorted({r["app"] for r in requests})
    groups = [("all", requests)]
    if len(apps) > 1:
        groups += [(a, [r for r in requests if r["app"] == a]) for a in apps]
    panels = []
    for key, label, slo in (("ttft_s", "TTFT, s", result["summary"]["slo"]["ttft_s"]),
                            ("tpot_s", "TPOT, s", result["summary"]["slo"]["tpot_s"]),
                            ("e2e_s", "end-to-end latency, s", None)):  # fmt: skip
        panel = Panel("fraction of requests", xlabel=label, title=f"{label.split(',')[0]} CDF")
        for i, (name, rows) in enumerate(groups):
            values = [r[key] for r in rows if r[key] is not None]
            if values:
                panel.series.append(cdf_series(name, values, color=f"C{i % 10}"))
        if slo is not None:
            panel.series.append(Series(f"SLO {slo:g} s", [slo, slo], [0, 1], color="k", linestyle=":",
                                       marker=None))
        panels.append(panel)
    s, rate = result["summary"], result["config"]["rate"]
    offered = f"offered {rate:g} req/s, " if rate else ""
    title = (f"{result['server']['name']}, {offered}served {s['request_throughput']:.3g} req/s: "
             f"{s['completed']}/{s['requests']} completed, goodput {s['goodput']:.3g} req/s")  # fmt: skip
    return plot_panels(path, panels, title=title)


def print_summary(result: dict[str, Any]) -> None:
    s = result["summary"]
    print_table(
        f"bench serve against {result['server']['target']} ({result['server']['name']})",
        ["requests", "completed", "failed", "duration s", "req/s", "output tok/s", "goodput req/s",
         "SLO attained"],
        [[s["requests"], s["completed"], s["failed"], s["duration_s"], s["request_throughput"],
          s["output_throughput"], s["goodput"], s["slo_attainment"]]],
    )  # fmt: skip
    rows = []
    for key, name in (("ttft_s", "TTFT ms"), ("tpot_s", "TPOT ms"), ("itl_s", "ITL ms"), ("e2e_s", "e2e ms")):
        st = s[key]
        rows.append([name, st["count"], *(None if st[k] is None else st[k] * 1e3
                                          for k in ("mean", "p50", "p90", "p99", "max"))])  # fmt: skip
    print_table("latency per request (ITL: per streamed chunk)",
                ["metric", "n", "mean", "p50", "p90", "p99", "max"], rows)  # fmt: skip


def main(args: argparse.Namespace) -> int:
    if (args.rate is not None and not args.rate > 0) or args.rate_scale <= 0 or args.num_requests < 1:
        raise SystemExit("pipeserve bench serve: --rate, --rate-scale and --num-requests must be > 0")
    slo = SLO(ttft=args.slo_ttft, tpot=args.slo_tpot)
    load = {"start": os.getloadavg()}
    try:
        server, outcomes, duration = asyncio.run(replay(args))
    except (ValueError, OSError) as exc:  # a bad option or an unreadable trace file
        raise SystemExit(f"pipeserve bench serve: {exc}") from None
    if not outcomes:
        raise SystemExit("pipeserve bench serve: the workload is empty (check --duration and --trace)")
    load["end"] = os.getloadavg()
    records = [o.record for o in outcomes]
    traces = args.trace or default_trace_paths()
    start = min(r.send_time for r in records)
    apps = sorted({r.app for r in records})
    result = {
        "bench": "serve",
        "machine": {**machine_info(), "load_average": load},
        "server": server,
        "config": {
            "traces": None if args.input_len is not None else [str(p) for p in traces],
            "rate": None if args.rate is None or math.isinf(args.rate) else args.rate,
            "all_at_once": args.rate is not None and math.isinf(args.rate),
            "rate_scale": args.rate_scale if args.rate is None else None,
            "burstiness": args.burstiness if args.rate is not None else None,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_requests": args.num_requests,
            "duration": args.duration,
            "timeout": args.timeout,
            "seed": args.seed,
        },
        "summary": summarize(records, duration, slo),
        "apps": {app: summarize([r for r in records if r.app == app], duration, slo) for app in apps},
        "requests": [request_json(o, start) for o in outcomes],
    }
    print_summary(result)
    errors = sorted({o.record.error for o in outcomes if o.record.error})
    for error in errors[:5]:
        print(f"error: {error}")
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    if args.out:
        print(f"wrote {plot(result, Path(args.out) / 'serve.png')}")
    return 0
