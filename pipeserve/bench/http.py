"""`pipeserve bench http`: what the OpenAI-compatible HTTP front end costs against gRPC.

One pipeline (gateway, tokenizers, detokenizer) around part 2's SyntheticEngine (pipeserve/bench/pipeline.py:
it echoes each prompt's ids, one token per running request per step, as fast as the detokenizer
takes them), so the figures are the front ends', not a model's. Both front ends are driven by
this process with the clients of `bench serve` (gRPC: pipeserve.gateway.client; HTTP: aiohttp
streaming /v1/completions with return_token_ids), alternated round by round so that the shared
machine's load falls on both alike; medians over the rounds.
- added TTFT at low load: --ttft-requests requests one after another (--ttft-output-len tokens);
- capacity: --streams concurrent streams of --output-len tokens, output tokens/s at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import tempfile
import time
from typing import Any

from pipeserve.bench.metrics import summarize
from pipeserve.bench.pipeline import TEXT, pipeline
from pipeserve.bench.report import machine_info, print_table, write_json
from pipeserve.bench.serve import Outcome, Planned, http_session, send, send_openai
from pipeserve.bench.shapes import LLAMA_20M_BYTES
from pipeserve.config import EngineConfig
from pipeserve.local_cluster import free_port

TTFT_TARGET_MS = 1.0  # HTTP TTFT p50 within this of gRPC's
THROUGHPUT_TARGET = 20000.0  # output tokens/s over HTTP at --streams


async def run(api: str, target: str, url: str, prompt: list[int], count: int, output_len: int,
              sequential: bool) -> tuple[list[Outcome], float]:
    """count requests through one front end, all at once or one after another."""
    from pipeserve.gateway.client import AsyncClient

    work = [Planned(0.0, len(prompt), output_len, "bench") for _ in range(count)]
    async with AsyncClient(target) as grpc_client, http_session(url) as http:
        await grpc_client.wait_ready(60.0)

        async def one(w: Planned) -> Outcome:
            if api == "grpc":
                return await send(grpc_client, w, prompt, 300.0)
            return await send_openai(http, w, prompt, 300.0)

        start = time.perf_counter()
        if sequential:
            outcomes = [await one(w) for w in work]
        else:
            outcomes = list(await asyncio.gather(*(one(w) for w in work)))
    ends = [o.record.chunk_times[-1] for o in outcomes if o.record.chunk_times]
    end = max(ends, default=time.perf_counter())
    errors = sorted({o.record.error for o in outcomes if o.record.error})
    if errors:
        raise RuntimeError(f"{api}: {len(errors)} kinds of error, e.g. {errors[0]}")
    return outcomes, end - start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="alternated gRPC/HTTP rounds of each measure")
    parser.add_argument("--ttft-requests", type=int, default=40, help="sequential requests per round (TTFT)")
    parser.add_argument("--ttft-output-len", type=int, default=4, help="their output tokens")
    parser.add_argument("--streams", type=int, default=256, help="concurrent streams of the capacity runs")
    parser.add_argument("--output-len", type=int, default=400, help="tokens per stream of the capacity runs")
    parser.add_argument("--tokenizer-workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    from pipeserve.demo import save_byte_tokenizer
    from pipeserve.tokenizer.load import load_tokenizer

    if min(args.rounds, args.ttft_requests, args.streams, args.output_len) < 1:
        raise SystemExit("pipeserve bench http: every count must be >= 1")
    load: dict[str, Any] = {"start": os.getloadavg()}
    ttft: dict[str, list[float]] = {"grpc": [], "openai": []}  # per-round median TTFT, s
    speed: dict[str, list[float]] = {"grpc": [], "openai": []}  # per-round output tokens/s
    with tempfile.TemporaryDirectory(prefix="pipeserve-bench-http-") as model_dir:
        write_json(os.path.join(model_dir, "config.json"), LLAMA_20M_BYTES)
        save_byte_tokenizer(model_dir, LLAMA_20M_BYTES["max_position_embeddings"])
        prompt = load_tokenizer(model_dir).encode(TEXT, add_special_tokens=False)
        http_port = free_port()
        url = f"http://127.0.0.1:{http_port}"
        with pipeline(EngineConfig(model=model_dir, device="cpu"), args.tokenizer_workers, synthetic=True,
                      http_port=http_port) as target:
            for api in ("grpc", "openai"):  # warm-up: connections, first-use imports
                asyncio.run(run(api, target, url, prompt, 8, 8, False))
            for r in range(args.rounds):
                order = ("grpc", "openai") if r % 2 == 0 else ("openai", "grpc")
                for api in order:
                    outcomes, _ = asyncio.run(run(api, target, url, prompt, args.ttft_requests,
                                                  args.ttft_output_len, True))
                    ttft[api].append(statistics.median(o.record.ttft for o in outcomes))
                load[f"ttft_round_{r}"] = os.getloadavg()
                for api in order:
                    outcomes, duration = asyncio.run(
                        run(api, target, url, prompt, args.streams, args.output_len, False))
                    speed[api].append(summarize([o.record for o in outcomes], duration)["output_throughput"])
                load[f"capacity_round_{r}"] = os.getloadavg()
    load["end"] = os.getloadavg()
    ttft_ms = {api: statistics.median(v) * 1e3 for api, v in ttft.items()}
    tokens_s = {api: statistics.median(v) for api, v in speed.items()}
    added = ttft_ms["openai"] - ttft_ms["grpc"]
    result = {
        "bench": "http",
        "machine": {**machine_info(), "load_average": load},
        "config": {k: getattr(args, k) for k in ("rounds", "ttft_requests", "ttft_output_len", "streams",
                                                 "output_len", "tokenizer_workers")},
        "ttft_p50_ms": ttft_ms,
        "ttft_p50_ms_rounds": {api: [t * 1e3 for t in v] for api, v in ttft.items()},
        "added_ttft_p50_ms": added,
        "ttft_target_ms": TTFT_TARGET_MS,
        "ttft_met": added <= TTFT_TARGET_MS,
        "tokens_per_s": tokens_s,
        "tokens_per_s_rounds": speed,
        "throughput_target": THROUGHPUT_TARGET,
        "throughput_met": tokens_s["openai"] >= THROUGHPUT_TARGET,
    }
    print_table(f"OpenAI HTTP vs gRPC, synthetic engine, medians of {args.rounds} alternated rounds",
                ["front end", "TTFT p50 ms", f"tokens/s at {args.streams} streams"],
                [[api, ttft_ms[api], tokens_s[api]] for api in ("grpc", "openai")])
    print(f"HTTP adds {added:.3f} ms to TTFT p50 (target <= {TTFT_TARGET_MS} ms: "
          f"{'met' if result['ttft_met'] else 'missed'}); HTTP carries {tokens_s['openai']:.0f} tokens/s "
          f"(target >= {THROUGHPUT_TARGET:.0f}: {'met' if result['throughput_met'] else 'missed'})")
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    return 0
