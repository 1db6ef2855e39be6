"""`pipeserve bench dp`: `pipeserve bench serve`'s workload against `pipeserve up --data-parallel-size N`
for each N in --sizes, alternated (N=1, N=2, N=1, ...) for --repeats rounds, so that a noisy machine's
drift falls on every size alike; the table gives each size's median over the rounds.

Each run starts its own server (pipeserve/local_cluster.LocalCluster, the real `pipeserve up`), waits
for SERVING, replays the workload (pipeserve/bench/serve.py: synthetic prompt ids, greedy, ignore_eos, an open
loop at --rate) and stops it. On a CPU-only host the launcher deals the engine cores out among the
engines (pipeserve/cpus.py): with fewer cores than engines they share them, which is what a small
machine can show; the gateway, tokenizers and detokenizer keep the remaining core.

JSON (--json): machine (with the load average before and after), config, runs[] (size, round,
summary of pipeserve/bench/metrics.py, routed requests per engine), medians {size: {metric: median}}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from pipeserve.bench import serve
from pipeserve.bench.metrics import SLO, summarize
from pipeserve.bench.report import machine_info, print_table, write_json
from pipeserve.bench.shapes import stories260k
from pipeserve.local_cluster import LocalCluster

METRICS = (
    ("req/s", lambda s: s["request_throughput"]),
    ("output tok/s", lambda s: s["output_throughput"]),
    ("TTFT p50 ms", lambda s: s["ttft_s"]["p50"] * 1e3),
    ("TTFT p99 ms", lambda s: s["ttft_s"]["p99"] * 1e3),
    ("TPOT p50 ms", lambda s: s["tpot_s"]["p50"] * 1e3),
    ("e2e p50 ms", lambda s: s["e2e_s"]["p50"] * 1e3),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint dir or hub id (default: the shared stories260K, else the demo "
                        "model)")
    parser.add_argument("--sizes", default="1,2", help="data parallel sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the sizes")
    parser.add_argument("--tokenizer-workers", type=int, default=2, help="tokenizer processes")
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s (Poisson; 'inf': all at once)")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    parser.add_argument("--num-requests", type=int, default=200, help="requests per run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrivals and prompts")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")


def workload(args: argparse.Namespace, target: str) -> argparse.Namespace:
    """bench serve's options for this run."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(["--target", target, "--rate", str(args.rate), "--input-len",
                              str(args.input_len), "--output-len", str(args.output_len), "--num-requests",
                              str(args.num_requests), "--seed", str(args.seed), "--ready-timeout", "120"])


def run_one(args: argparse.Namespace, size: int, log_dir: Path) -> dict[str, Any]:
    model = args.model or stories260k()
    with LocalCluster(log_dir / f"up-dp{size}.log", model, "--data-parallel-size", str(size),
                      workers=args.tokenizer_workers, startup=300) as cluster:
        cluster.wait_engines(size)
        _, outcomes, duration = asyncio.run(serve.replay(workload(args, cluster.target)))
        metrics = cluster.metrics()
    records = [o.record for o in outcomes]
    routed = [metrics.get(f'pipeserve_gateway_routed_requests_total{{engine="{i}"}}', 0.0)
              for i in range(size)]
    return {"size": size, "summary": summarize(records, duration, SLO()), "routed": routed}


def main(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.repeats < 1 or not sizes or min(sizes) < 1:
        raise SystemExit("pipeserve bench dp: --repeats and every --sizes entry must be >= 1")
    load = {"start": os.getloadavg()}
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as logs:
        for round_ in range(args.repeats):
            for size in sizes:
                run = run_one(args, size, Path(logs)) | {"round": round_}
                s = run["summary"]
                print(f"round {round_} dp={size}: {s['completed']}/{s['requests']} completed, "
                      f"{s['request_throughput']:.3g} req/s, routed {run['routed']}")
                runs.append(run)
    load["end"] = os.getloadavg()
    medians = {str(size): {name: statistics.median(f(r["summary"]) for r in runs if r["size"] == size)
                           for name, f in METRICS} for size in sizes}
    print_table(f"data parallel sizes, medians of {args.repeats} alternated runs ({args.num_requests} "
                f"requests at {args.rate:g} req/s, {args.input_len} in / {args.output_len} out)",
                ["dp", *(name for name, _ in METRICS)],
                [[size, *medians[str(size)].values()] for size in sizes])
    result = {"bench": "dp", "machine": {**machine_info(), "load_average": load}, "config": vars(args) | {
        "model": args.model or stories260k()}, "runs": runs, "medians": medians}
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    return 0
