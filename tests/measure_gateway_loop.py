"""Measurement (not a test): how long `/health` and `/metrics` take to answer, and a plain stream's
inter-token latency, while two streamed completions with `n: 24, logprobs: 20` and 440 tokens each
run on a `pipeserve up` of stories260K. Probes, the heavy clients and the plain stream each run in
their own process, so a busy client cannot delay a probe.

    PIPESERVE_SHARED=... python -m tests.measure_gateway_loop OUT.json [server.log]
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from pipeserve.local_cluster import LocalCluster

PROMPT = "Once upon a time"
HEAVY = {"prompt": PROMPT, "max_tokens": 440, "ignore_eos": True, "stream": True, "n": 24, "logprobs": 20}
PLAIN = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}


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
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return {"n": len(values), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": ordered[-1] * 1e3}


def measure(url: str) -> dict[str, Any]:
    asyncio.run(stream(url, HEAVY | {"max_tokens": 8}))  # warm: the first requests pay one-time costs
    asyncio.run(stream(url, PLAIN))
    unloaded = gaps(asyncio.run(stream(url, PLAIN)))
    stop = mp.Event()
    out = {name: mp.Queue() for name in ("health", "metrics", "plain", "heavy0", "heavy1")}
    probes = [mp.Process(target=probe, args=(url, f"/{name}", out[name], stop))
              for name in ("health", "metrics")]
    heavy = [mp.Process(target=streamed, args=(url, HEAVY, out[f"heavy{i}"])) for i in range(2)]
    for proc in probes + heavy:
        proc.start()
    time.sleep(1.0)  # the heavy streams are under way
    plain = mp.Process(target=streamed, args=(url, PLAIN, out["plain"]))
    plain.start()
    loaded = gaps(out["plain"].get())
    events = [len(out[f"heavy{i}"].get()) for i in range(2)]
    stop.set()
    result = {"health": summary(out["health"].get()), "metrics": summary(out["metrics"].get()),
              "plain_itl_unloaded": summary(unloaded),
              "plain_itl_loaded": summary(loaded) if loaded else {"n": 0},
              "heavy_stream_events": events}
    for proc in [*probes, *heavy, plain]:
        proc.join()
    result["plain_itl_p50_ratio"] = (statistics.median(loaded) / statistics.median(unloaded)
                                     if loaded and unloaded else None)
    return result


def main(out: str, log: str = "/tmp/measure_gateway_loop.log") -> None:
    model = os.path.join(os.environ["PIPESERVE_SHARED"], "models", "stories260K")
    with LocalCluster(Path(log), model, workers=1) as cluster:
        result = measure(cluster.http_url)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
