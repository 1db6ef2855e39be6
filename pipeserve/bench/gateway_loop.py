"""`pipeserve bench gateway-loop`: is the gateway's event loop free while heavy requests stream?

Starts `pipeserve up` (stories260K by default, one tokenizer worker) and, while --heavy streamed
completions with `n: 24, logprobs: 20` and 440 tokens each run, measures how long `/health` and
`/metrics` take to answer (each probed every 50 ms from its own process) and the inter-token latency
of a plain 200-token stream, against the same stream on the idle server. Probes, heavy clients and
the plain stream each run in their own process, so a busy client cannot delay a probe. Beside the
latencies: the plain stream's tokens per SSE event (1: no token waited behind another's event)
and the engine's step period over the loaded stream (from its step counter), the floor of its ITL
whatever the gateway does: every running request gets one token per engine step; and the CPU each
process (server and clients) spent per engine step meanwhile, the budget that period is made of.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pipeserve.bench.report import machine_info, print_table, write_json
from pipeserve.bench.shapes import stories260k
from pipeserve.local_cluster import LocalCluster

PROMPT = "Once upon a time"
HEAVY = {"prompt": PROMPT, "max_tokens": 440, "ignore_eos": True, "stream": True, "n": 24, "logprobs": 20}
PLAIN_TOKENS = 200
PLAIN = {"prompt": PROMPT, "max_tokens": PLAIN_TOKENS, "ignore_eos": True, "stream": True}
TARGETS = {"probe_p99_ms": 50.0, "plain_itl_p50_ratio": 2.0}


def probe(url: str, path: str, out: Any, stop: Any) -> None:
    """GET path every 50 ms until stop; the latencies (s) into out."""
    seen = []
    with httpx.Client(base_url=url, timeout=60) as http:
        while not stop.is_set():
            start = time.perf_counter()
            assert http.get(path).status_code == 200
            seen.append(time.perf_counter() - start)
            time.sleep(0.05)
    out.put(seen)


async def stream(url: str, body: dict[str, Any]) -> list[float]:
    """The stream's SSE events' arrival times."""
    times = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
    return times


def streamed(url: str, body: dict[str, Any], out: Any) -> None:
    out.put(asyncio.run(stream(url, body)))


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return {"n": len(values), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": ordered[-1] * 1e3}


def cpu_seconds(pid: int) -> float:
    """A live process's user + system CPU time so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def cpu_per_step(pids: dict[str, int], before: dict[str, float], steps: float) -> dict[str, float]:
    """Each process's CPU milliseconds per engine step since `before` (its CPU seconds then)."""
    return {name: (cpu_seconds(pid) - before[name]) * 1e3 / max(1.0, steps) for name, pid in pids.items()}


def measure(cluster: LocalCluster, heavy_streams: int = 2) -> dict[str, Any]:
    url = cluster.http_url
    asyncio.run(stream(url, HEAVY | {"max_tokens": 8}))  # warm: the first requests pay one-time costs
    asyncio.run(stream(url, PLAIN))
    unloaded = gaps(asyncio.run(stream(url, PLAIN)))
    stop = mp.Event()
    names = ("health", "metrics", "plain", *[f"heavy{i}" for i in range(heavy_streams)])
    out: dict[str, Any] = {name: mp.Queue() for name in names}
    probes = [mp.Process(target=probe, args=(url, f"/{name}", out[name], stop))
              for name in ("health", "metrics")]
    heavy = [mp.Process(target=streamed, args=(url, HEAVY, out[f"heavy{i}"])) for i in range(heavy_streams)]
    for proc in probes + heavy:
        proc.start()
    time.sleep(1.0)  # the heavy streams are under way
    steps_before, at_before = cluster.engine("steps"), time.monotonic()
    plain = mp.Process(target=streamed, args=(url, PLAIN, out["plain"]))
    plain.start()
    # Where the CPU goes while the plain stream runs: the server's processes and the clients, which
    # share the machine's cores with them.
    pids = cluster.processes() | {"plain client": plain.pid or 0} | {
        f"heavy client {i}": proc.pid or 0 for i, proc in enumerate(heavy)} | {
        f"{name} probe": proc.pid or 0 for name, proc in zip(("health", "metrics"), probes, strict=True)}
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    plain_times = out["plain"].get()
    steps_after, at_after = cluster.engine("steps"), time.monotonic()
    # The plain request takes one token from every step from its first to its last: its token count
    # is the steps the CPU was spent over (the heartbeats' counter is up to 0.5 s stale at each end).
    cpu = cpu_per_step(pids, cpu_before, PLAIN_TOKENS)
    loaded = gaps(plain_times)
    events = [len(out[f"heavy{i}"].get()) for i in range(heavy_streams)]
    stop.set()
    result: dict[str, Any] = {
        "health": summary(out["health"].get()), "metrics": summary(out["metrics"].get()),
        "plain_itl_unloaded": summary(unloaded), "plain_itl_loaded": summary(loaded),
        "plain_tokens_per_event_loaded": PLAIN_TOKENS / max(1, len(plain_times)),
        # Heartbeats carry the counter every 0.5 s: over the several seconds of the plain stream the
        # period is good to a few per cent.
        "engine_step_ms_loaded": (at_after - at_before) * 1e3 / max(1.0, steps_after - steps_before),
        "heavy_stream_events": events,
        "cpu_ms_per_step_loaded": cpu,
        "cpu_ms_per_step_loaded_total": sum(cpu.values()),
    }
    for proc in [*probes, *heavy, plain]:
        proc.join()
    result["plain_itl_p50_ratio"] = (statistics.median(loaded) / statistics.median(unloaded)
                                     if loaded and unloaded else None)
    worst = max(result["health"].get("p99_ms", 0.0), result["metrics"].get("p99_ms", 0.0))
    ratio = result["plain_itl_p50_ratio"]
    result["met"] = {"probe_p99": worst <= TARGETS["probe_p99_ms"],
                     "plain_itl_p50_ratio": ratio is not None and ratio <= TARGETS["plain_itl_p50_ratio"]}
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=stories260k(),
                        help="checkpoint dir (default: the shared stories260K)")
    parser.add_argument("--heavy", type=int, default=2, help="heavy streams (n 24, logprobs 20, 440 tokens)")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")


def main(args: argparse.Namespace) -> int:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pipeserve-gateway-loop-") as tmp:
        with LocalCluster(Path(tmp) / "up.log", args.model, workers=1) as cluster:
            result = measure(cluster, args.heavy)
    result |= {"machine": machine_info(), "load_average": {"before": load_before, "after": os.getloadavg()}}
    rows = [[name, result[name].get("n", 0), result[name].get("p50_ms"), result[name].get("p99_ms"),
             result[name].get("max_ms")]
            for name in ("health", "metrics", "plain_itl_unloaded", "plain_itl_loaded")]
    ratio = result["plain_itl_p50_ratio"]
    print_table(f"gateway loop: {args.heavy} streams of n 24 x 440 tokens, logprobs 20",
                ["figure", "samples", "p50 ms", "p99 ms", "max ms"], rows,
                caption=f"plain ITL p50 loaded / unloaded {ratio or float('nan'):.2f} (target <= 2); "
                f"{result['plain_tokens_per_event_loaded']:.2f} tokens per event; engine step "
                f"{result['engine_step_ms_loaded']:.1f} ms under the load; load average "
                f"{load_before[0]:.1f} before")
    print_table("CPU per engine step while the plain stream runs beside the heavy ones",
                ["process", "CPU ms per step"], sorted(result["cpu_ms_per_step_loaded"].items()),
                caption=f"total {result['cpu_ms_per_step_loaded_total']:.2f} ms per step on "
                f"{len(os.sched_getaffinity(0))} cores")
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    return 0
