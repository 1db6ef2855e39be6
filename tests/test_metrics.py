"""Serving metrics on synthetic timestamps with known answers; arrivals and the trace loader."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pipeserve.bench.metrics import SLO, RequestRecord, stats, summarize
from pipeserve.bench.workload import default_trace_paths, gamma_arrivals, load_trace

pytestmark = pytest.mark.timeout(60)


def record(
    send: float, chunks: list[tuple[float, int]], prompt_tokens: int = 0, error: str | None = None
) -> RequestRecord:
    r = RequestRecord(send_time=send, prompt_tokens=prompt_tokens, error=error)
    for t, n in chunks:
        r.add_chunk(t, n)
    return r


def test_request_metrics() -> None:
    r = record(10.0, [(10.5, 1), (10.6, 2), (10.6, 0), (10.9, 1)])
    assert r.ok and r.output_tokens == 4
    assert r.chunk_times == [10.5, 10.6, 10.9]  # an empty chunk carries no token and is not a gap
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(0.9)
    assert r.tpot == pytest.approx(0.4 / 3)  # (e2e - TTFT) / (tokens - 1)
    assert r.itl == pytest.approx([0.1, 0.3])
    one = record(0.0, [(0.2, 1)])
    assert one.tpot is None and one.itl == []
    assert not record(0.0, []).ok
    assert not record(0.0, [(1.0, 3)], error="RESOURCE_EXHAUSTED").ok


def test_slo() -> None:
    slo = SLO()
    assert (slo.ttft, slo.tpot) == (2.0, 0.05)
    assert slo.met(record(0.0, [(2.0, 1), (2.5, 10)]))  # TTFT 2 s, TPOT 50 ms: on the line
    assert not slo.met(record(0.0, [(2.01, 1)]))
    assert not slo.met(record(0.0, [(0.1, 1), (0.7, 10)]))  # TPOT 60 ms
    assert slo.met(record(0.0, [(1.0, 1)]))  # one token: no TPOT to miss
    assert not slo.met(record(0.0, [], error="timeout"))
    assert SLO(ttft=0.5, tpot=0.1).met(record(0.0, [(0.4, 1), (1.0, 7)]))


def test_stats_percentiles() -> None:
    s = stats([0.1 * i for i in range(1, 11)])
    assert s["count"] == 10
    assert s["mean"] == pytest.approx(0.55)
    assert s["p50"] == pytest.approx(0.55)  # linear interpolation between the 5th and 6th values
    assert s["p90"] == pytest.approx(0.91)
    assert s["p99"] == pytest.approx(0.991)
    assert s["max"] == pytest.approx(1.0)
    assert stats([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    assert set(stats([1.0], percentiles=(25, 99.9))) == {"count", "mean", "p25", "p99.9", "max"}


def test_summarize_known_run() -> None:
    records = [
        # TTFT 0.5, TPOT 0.02: good.
        record(0.0, [(0.5, 1), (0.52, 1), (0.54, 1)], prompt_tokens=100),
        # TTFT 3.0: misses the TTFT SLO.
        record(1.0, [(4.0, 1), (4.04, 2)], prompt_tokens=200),
        # TTFT 1.0, TPOT 0.1: misses the TPOT SLO.
        record(2.0, [(3.0, 1), (3.1, 1), (3.2, 1)], prompt_tokens=300),
        # Failed after streaming: counts as a request, never as good, and not in the latencies.
        record(3.0, [(3.1, 1)], prompt_tokens=400, error="aborted"),
    ]
    s = summarize(records, duration=5.0)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["input_tokens"] == 600 and s["output_tokens"] == 9
    assert s["request_throughput"] == pytest.approx(3 / 5)
    assert s["output_throughput"] == pytest.approx(9 / 5)
    assert s["goodput"] == pytest.approx(1 / 5)
    assert s["slo_attainment"] == pytest.approx(1 / 4)
    assert s["slo"] == {"ttft_s": 2.0, "tpot_s": 0.05}
    assert s["ttft_s"]["count"] == 3 and s["ttft_s"]["p50"] == pytest.approx(1.0)
    assert s["ttft_s"]["max"] == pytest.approx(3.0)
    assert s["tpot_s"]["mean"] == pytest.approx((0.02 + 0.02 + 0.1) / 3)  # the 2nd: 0.04 / 2 tokens
    assert s["itl_s"]["max"] == pytest.approx(0.1)
    assert s["itl_s"]["count"] == 2 + 1 + 2
    assert s["e2e_s"]["mean"] == pytest.approx((0.54 + 3.04 + 1.2) / 3)
    # A looser SLO counts all three completed requests.
    assert summarize(records, 5.0, SLO(ttft=5.0, tpot=0.2))["goodput"] == pytest.approx(3 / 5)
    with pytest.raises(ValueError):
        summarize(records, 0.0)


def test_gamma_arrivals() -> None:
    a = gamma_arrivals(20_000, rate=4.0, burstiness=1.0, seed=7)
    assert a[0] == 0.0 and a == sorted(a) and len(a) == 20_000
    assert a == gamma_arrivals(20_000, rate=4.0, burstiness=1.0, seed=7)
    assert a != gamma_arrivals(20_000, rate=4.0, burstiness=1.0, seed=8)
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1.0, rel=0.05)  # Poisson: CV^2 = 1
    bursty = np.diff(gamma_arrivals(20_000, rate=4.0, burstiness=0.25, seed=7))
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.1)  # CV^2 = 1 / burstiness
    assert gamma_arrivals(3, rate=math.inf) == [0.0, 0.0, 0.0]
    assert gamma_arrivals(0, rate=1.0) == []
    with pytest.raises(ValueError):
        gamma_arrivals(5, rate=0.0)


def write_csv(path: Path, rows: list[tuple[str, int, int]]) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [f"{t},{p},{o}" for t, p, o in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_trace_synthetic(tmp_path: Path) -> None:
    chat = write_csv(
        tmp_path / "chat.csv",
        [("2023-11-16 18:00:00.5000000", 100, 50), ("2023-11-16 18:00:02.0000000", 300, 700)],
    )
    code = write_csv(
        tmp_path / "code.csv",
        [("2023-11-16 18:00:01.2500000", 600, 10), ("2023-11-16 18:00:04.5000000", 20, 1)],
    )
    trace = load_trace([chat, code])
    assert [(r.arrival, r.prompt_tokens, r.output_tokens, r.app) for r in trace] == [
        (0.0, 100, 50, "chat"),
        (pytest.approx(0.75), 600, 10, "code"),
        (pytest.approx(1.5), 300, 700, "chat"),
        (pytest.approx(4.0), 20, 1, "code"),
    ]
    assert [r.arrival for r in load_trace([chat, code], rate_scale=2.0)] == pytest.approx(
        [0, 0.375, 0.75, 2.0]
    )
    assert len(load_trace([chat, code], window_s=1.5)) == 2
    assert len(load_trace([chat, code], max_requests=3)) == 3
    assert [r.app for r in load_trace(code)] == ["code", "code"]
    # Longest request is 300 + 700 = 1000 tokens; at 100 tokens of context every length is scaled by 0.1.
    scaled = load_trace([chat, code], max_context=100)
    assert [(r.prompt_tokens, r.output_tokens) for r in scaled] == [(10, 5), (60, 1), (30, 70), (2, 1)]
    assert all(r.prompt_tokens + r.output_tokens <= 100 for r in scaled)
    assert load_trace([chat, code], max_context=5000) == trace  # already fits: unchanged


@pytest.mark.skipif(not default_trace_paths(), reason="no traces under $PIPESERVE_SHARED/data/traces")
def test_load_real_traces() -> None:
    paths = default_trace_paths()
    trace = load_trace(paths, max_context=512)
    assert len(trace) == 19_366 + 8_819
    assert {r.app for r in trace} == {p.stem for p in paths}
    arrivals = [r.arrival for r in trace]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert 55 * 60 < arrivals[-1] < 62 * 60  # the traces span about an hour
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in trace)
    assert all(r.prompt_tokens + r.output_tokens <= 512 for r in trace)
    fast = load_trace(paths, rate_scale=10.0, window_s=60.0)
    assert fast and fast[-1].arrival < 60.0
    assert len(fast) == sum(a < 600.0 for a in arrivals)
