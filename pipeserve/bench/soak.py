"""`pipeserve bench soak`: does memory stay flat under steady load?

Starts `pipeserve up` (stories260K by default, any --model) and offers a steady mixed load for
`--seconds` (10 minutes by default): `--rate` requests per second (at most `--concurrency` streams
open), text and token-id prompts of varied length, 1..64 output tokens, greedy and sampled, some
with stop strings, top-k/top-p or logprobs, and ~30% cancelled at a random point (before admission,
mid-stream, after the last token). A fixed rate, not as-fast-as-possible, so that MiB/min means the
same per request on any machine. Every few seconds it samples the resident memory of every process
of the pipeline (launcher, gateway, tokenizers, engine, detokenizer: the launcher's children, read
from /proc) and the KV pages in use.

Growth per process: the least-squares slope over the second half of the run (the first half is
warm-up: allocator arenas, caches and gRPC buffers fill to their working size), in MiB/min and per
request, and first vs last sample. Verdict: flat when every slope is at most --threshold MiB/min
(default 1.0, i.e. ~1.7 KiB per request at the default 10 requests/s: 10 MiB over a 10-minute run;
3.0 for runs under 5 minutes, whose 30-s fit cannot tell an allocator step from a leak: see
tests/reliability/test_soak.py for the slopes measured).
Known bounded growth: each tokenizer's `tokenizers` BPE cache keeps up to 10,000 whole prompts
(stories260K's tokenizer has no pre-tokenizer, so a prompt under 256 bytes is one cached "word"), ~49 MiB
when full: it filled at ~0.6 MiB/min at the default rate here (prompts over 256 bytes are not
cached), so it keeps growing for over an hour. After the load, KV pages in use and every
per-request count in the pipeline must be back to 0. Writes JSON and a PNG plot.

    pipeserve bench soak --out DIR --json DIR/soak.json      # 10 minutes
    pipeserve bench soak --seconds 3600 --model /path/to/checkpoint --out /tmp/soak

Not run by the tests at this length: tests/reliability/test_soak.py runs 60 seconds of it.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pipeserve.bench.report import Panel, Series, machine_info, plot_panels, print_table, write_json
from pipeserve.bench.shapes import stories260k
from pipeserve.gateway.client import AsyncClient
from pipeserve.local_cluster import LocalCluster

THRESHOLD_MB_PER_MIN = 1.0  # runs of 5 minutes or more
SHORT_THRESHOLD_MB_PER_MIN = 3.0  # shorter runs (the 60-s test and `bench reliability`)


def default_threshold(seconds: float) -> float:
    return THRESHOLD_MB_PER_MIN if seconds >= 300 else SHORT_THRESHOLD_MB_PER_MIN


PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog", "Tom had a red ball"]
WORDS = (
    "the a little big dog cat sun tree happy sad ran jumped saw played with her his friend and then".split()
)
STOPS = (".", "the", "\n", "!")


@dataclass
class Growth:
    process: str
    first_mb: float
    last_mb: float
    peak_mb: float
    slope_mb_per_min: float  # least-squares slope over the second half of the run
    kib_per_request: float  # the slope divided by the request rate
    flat: bool


@dataclass
class SoakResult:
    seconds: float
    rate: float  # requests/s offered
    concurrency: int
    cancel_rate: float
    threshold_mb_per_min: float
    requests: dict[str, int] = field(default_factory=dict)  # "completed", "cancelled", or an error status
    requests_per_s: float = math.nan  # achieved
    times: list[float] = field(default_factory=list)  # seconds since the load started, per sample
    rss_mb: dict[str, list[float]] = field(default_factory=dict)  # process -> one value per sample
    pages_used: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    growth: list[Growth] = field(default_factory=list)
    verdict: str = ""  # "flat", or "growing: <process> (<slope>), ..."
    pages_at_end: float = math.nan
    state_left: dict[str, float] = field(default_factory=dict)


def growth(
    process: str, times: list[float], values: list[float], threshold: float, requests_per_s: float
) -> Growth:
    """Growth of one RSS series: first vs last, and the slope fitted over the second half."""
    half = [(t, v) for t, v in zip(times, values, strict=True) if t >= times[-1] / 2 and not math.isnan(v)]
    slope = math.nan
    if len(half) >= 2:
        slope = statistics.linear_regression([t for t, _ in half], [v for _, v in half]).slope * 60
    per_request = slope * 1024 / (requests_per_s * 60)
    return Growth(process, values[0], values[-1], max(values), slope, per_request, slope <= threshold)


def _request_args(rng: random.Random, vocab: int, max_tokens: int) -> tuple[Any, dict[str, Any]]:
    """A prompt and sampling arguments drawn from the mix."""
    if rng.random() < 0.7:
        prompt: Any = " ".join([rng.choice(PROMPTS), *rng.choices(WORDS, k=rng.randint(0, 48))])
    else:
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 96))]
    kwargs: dict[str, Any] = {
        "max_tokens": rng.randint(1, max_tokens),
        "temperature": rng.choice((0.0, 0.8, 1.0)),
        "timeout": 60.0,
    }
    if rng.random() < 0.2:
        kwargs["stop"] = [rng.choice(STOPS)]
    if rng.random() < 0.2:
        kwargs |= {"top_k": 20, "top_p": 0.9}
    if rng.random() < 0.1:
        kwargs["logprobs"] = 2
    return prompt, kwargs


async def _request(client: AsyncClient, prompt: Any, kwargs: dict[str, Any], cancel_after: int | None) -> str:
    """One stream, cancelled after `cancel_after` messages (0: at once) unless it ends first."""
    call = client.stream(prompt, **kwargs)
    chunks = 0
    try:
        while cancel_after is None or chunks < cancel_after:
            if (await call.read()) is grpc.aio.EOF:
                return "completed"
            chunks += 1
        call.cancel()
        return "cancelled"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name


class _Pace:
    """Start times `1/rate` apart, shared by all clients; a slot missed while every client was busy
    is skipped rather than made up in a burst."""

    def __init__(self, rate: float) -> None:
        self.gap, self.next = 1.0 / rate, time.monotonic()

    async def wait(self) -> None:
        now = time.monotonic()
        slot = max(self.next, now)
        self.next = slot + self.gap
        await asyncio.sleep(slot - now)


async def _client(
    client: AsyncClient,
    result: SoakResult,
    stop: asyncio.Event,
    pace: _Pace,
    seed: int,
    vocab: int,
    max_tokens: int,
) -> None:
    rng = random.Random(seed)
    while True:
        await pace.wait()
        if stop.is_set():
            return
        prompt, kwargs = _request_args(rng, vocab, max_tokens)
        cancel_after = rng.randint(0, 8) if rng.random() < result.cancel_rate else None
        outcome = await _request(client, prompt, kwargs, cancel_after)
        result.requests[outcome] = result.requests.get(outcome, 0) + 1


async def soak(
    pipe: LocalCluster,
    seconds: float,
    rate: float = 10.0,
    concurrency: int = 8,
    interval: float | None = None,
    cancel_rate: float = 0.3,
    max_tokens: int = 64,
    threshold: float | None = None,
    seed: int = 0,
) -> SoakResult:
    """Run the load on `pipe` for `seconds`, sampling every `interval` (default: 30+ samples, 1-5 s
    apart); then wait until no request state is left anywhere."""
    interval = interval or min(5.0, max(1.0, seconds / 30))
    threshold = threshold or default_threshold(seconds)
    result = SoakResult(seconds, rate, concurrency, cancel_rate, threshold)
    vocab = pipe.client.model_info().vocab_size
    stop, pace = asyncio.Event(), _Pace(rate)
    async with AsyncClient(pipe.target, **pipe.security) as client:
        clients = [
            asyncio.create_task(_client(client, result, stop, pace, seed + i, vocab, max_tokens))
            for i in range(concurrency)
        ]
        start = time.monotonic()
        while (now := time.monotonic() - start) < seconds:
            rss, metrics = pipe.rss_mb(), await asyncio.to_thread(pipe.metrics)
            result.times.append(now)
            for name in rss.keys() | result.rss_mb.keys():
                series = result.rss_mb.setdefault(name, [math.nan] * (len(result.times) - 1))
                series.append(rss.get(name, math.nan))
            result.pages_used.append(metrics.get('pipeserve_engine{name="pages_used"}', math.nan))
            result.running.append(metrics.get('pipeserve_engine{name="running"}', math.nan))
            await asyncio.sleep(interval - (time.monotonic() - start) % interval)
        stop.set()
        result.requests_per_s = sum(result.requests.values()) / (time.monotonic() - start)
        await asyncio.gather(*clients)
    result.state_left = await asyncio.to_thread(pipe.wait_clean, 60.0)
    result.pages_at_end = result.state_left["pages_used"]
    result.growth = [
        growth(name, result.times, values, threshold, result.requests_per_s)
        for name, values in sorted(result.rss_mb.items())
    ]
    growing = [f"{g.process} ({g.slope_mb_per_min:+.2f} MiB/min)" for g in result.growth if not g.flat]
    result.verdict = "growing: " + ", ".join(growing) if growing else "flat"
    return result


def print_soak(result: SoakResult) -> None:
    requests = sum(result.requests.values())
    print_table(
        f"soak: {result.seconds:.0f} s, {requests:,} requests ({result.requests_per_s:.1f}/s)",
        ["process", "first MiB", "last MiB", "peak MiB", "MiB/min (2nd half)", "KiB/request", "flat"],
        [
            (g.process, g.first_mb, g.last_mb, g.peak_mb, g.slope_mb_per_min, g.kib_per_request, g.flat)
            for g in result.growth
        ],
        caption=f"verdict: {result.verdict} (threshold {result.threshold_mb_per_min:g} MiB/min); "
        f"requests {result.requests}; KV pages in use at the end {result.pages_at_end:g}",
    )


def plot_soak(result: SoakResult, path: str | Path) -> Path:
    minutes = [t / 60 for t in result.times]
    rss = Panel("RSS - first sample (MiB)", xlabel="minutes", title="resident memory per process")
    for name, values in sorted(result.rss_mb.items()):
        rss.series.append(Series(name, minutes, [v - values[0] for v in values], marker=None))
    pages = Panel("pages / requests", xlabel="minutes", title="KV pages in use, running requests")
    pages.series += [
        Series("KV pages in use", minutes, result.pages_used, marker=None),
        Series("running requests", minutes, result.running, marker=None),
    ]
    return plot_panels(path, [rss, pages], title=f"pipeserve bench soak: {result.verdict}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=stories260k(), help="checkpoint dir (default: the shared stories260K)"
    )
    parser.add_argument("--seconds", type=float, default=600.0, help="length of the load")
    parser.add_argument("--rate", type=float, default=10.0, help="requests started per second")
    parser.add_argument("--concurrency", type=int, default=8, help="most streams open at once")
    parser.add_argument("--interval", type=float, default=None, help="seconds between samples")
    parser.add_argument("--cancel-rate", type=float, default=0.3, help="share of requests cancelled")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens are drawn in 1..this")
    parser.add_argument(
        "--threshold",
        type=float,
        default=None,
        help=f"MiB/min above which RSS grows (default {THRESHOLD_MB_PER_MIN:g}, "
        f"{SHORT_THRESHOLD_MB_PER_MIN:g} under 5 minutes)",
    )
    parser.add_argument("--tokenizer-workers", type=int, default=2, help="tokenizer processes of the server")
    parser.add_argument("--json", metavar="PATH", help="write the samples and figures as JSON")
    parser.add_argument("--out", metavar="DIR", help="write soak.png into DIR")


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="pipeserve-soak-") as tmp:
        with LocalCluster(Path(tmp) / "up.log", args.model, workers=args.tokenizer_workers) as pipe:
            result = asyncio.run(
                soak(
                    pipe,
                    args.seconds,
                    args.rate,
                    args.concurrency,
                    args.interval,
                    args.cancel_rate,
                    args.max_tokens,
                    args.threshold,
                )
            )
    print_soak(result)
    if args.out:
        print(f"wrote {plot_soak(result, Path(args.out) / 'soak.png')}")
    if args.json:
        data = {"machine": machine_info(), "model": args.model or "demo", "soak": result}
        print(f"wrote {write_json(args.json, data)}")
    return 0 if result.verdict == "flat" and not result.pages_at_end else 1
