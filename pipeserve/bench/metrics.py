"""Serving metrics, defined once for every benchmark (and for the README).

Per request, from the client's clock (a `RequestRecord`: send time, arrival time and token count of
each streamed chunk that carries tokens):
    TTFT  = first streamed chunk time - send time.
    e2e   = last streamed chunk time - send time.
    TPOT  = (e2e - TTFT) / (output tokens - 1); undefined for a 1-token output.
    ITL   = every gap between consecutive streamed chunks (a chunk may carry several tokens, so
            ITL is what a reader sees; genai-perf's "ITL" is our TPOT).
Per run, over `duration` seconds (first send to last chunk, as the caller measured it):
    request_throughput = completed requests / duration (QPS).
    output_throughput  = output tokens of completed requests / duration.
    goodput            = requests meeting every SLO / duration (defaults TTFT <= 2 s, TPOT <= 50 ms);
                         a failed request never meets them.
Percentiles are numpy's linear interpolation. TTFT, TPOT and e2e come from completed requests,
ITL from every gap of completed requests.

`summarize` returns (times in seconds):
    requests, completed, failed: counts (failed: an error, or no token streamed);
    duration_s, input_tokens, output_tokens (completed requests);
    request_throughput, output_throughput, goodput (per second); slo_attainment (good / requests);
    slo: {ttft_s, tpot_s};
    ttft_s, tpot_s, itl_s, e2e_s: each {count, mean, p50, p90, p99, max} (null values when empty).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np


@dataclass
class RequestRecord:
    send_time: float  # s, the client's clock when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # s, arrival of each chunk carrying tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks
    prompt_tokens: int = 0
    error: str | None = None
    app: str = ""  # workload tag (the trace file), for per-application breakdowns

    def add_chunk(self, time: float, tokens: int) -> None:
        if tokens > 0:
            self.chunk_times.append(time)
            self.chunk_tokens.append(tokens)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.send_time

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in pairwise(self.chunk_times)]


@dataclass(frozen=True)
class SLO:
    ttft: float = 2.0  # s
    tpot: float = 0.05  # s

    def met(self, record: RequestRecord) -> bool:
        if not record.ok or record.ttft > self.ttft:
            return False
        tpot = record.tpot
        return tpot is None or tpot <= self.tpot


def stats(values: Sequence[float], percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, Any]:
    """count, mean, the percentiles as pNN, max; null values for an empty sample."""
    out: dict[str, Any] = {"count": len(values)}
    arr = np.asarray(values, dtype=float)
    out["mean"] = float(arr.mean()) if len(arr) else None
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(arr, p)) if len(arr) else None
    out["max"] = float(arr.max()) if len(arr) else None
    return out


def summarize(
    records: Sequence[RequestRecord],
    duration: float,
    slo: SLO = SLO(),
    percentiles: Sequence[float] = (50, 90, 99),
) -> dict[str, Any]:
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    done = [r for r in records if r.ok]
    good = sum(slo.met(r) for r in records)
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "input_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "goodput": good / duration,
        "slo_attainment": good / len(records) if records else None,
        "slo": {"ttft_s": slo.ttft, "tpot_s": slo.tpot},
        "ttft_s": stats([r.ttft for r in done], percentiles),
        "tpot_s": stats([t for r in done if (t := r.tpot) is not None], percentiles),
        "itl_s": stats([gap for r in done for gap in r.itl], percentiles),
        "e2e_s": stats([r.e2e for r in done], percentiles),
    }
