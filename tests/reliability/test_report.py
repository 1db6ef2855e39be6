"""The figures `pipeserve bench reliability` reports, from known results: the RSS growth fit, and the
report rows derived from the scenarios' result types (ratios, sums, leftovers), checked whole."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pipeserve.bench.reliability import FaultResult, OverloadResult, StormResult, report_rows
from pipeserve.bench.report import write_json
from pipeserve.bench.soak import SoakResult, growth

pytestmark = pytest.mark.timeout(30)

TIMES = [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0]


def test_growth_fits_the_second_half_only() -> None:
    # Warm-up noise in the first half; +1 MiB every 10 s from t = 30 s (the second half) on.
    values = [500.0, 580.0, 560.0, 600.0, 601.0, 602.0, 603.0]
    g = growth("engine", TIMES, values, threshold=1.0, requests_per_s=10.0)
    assert g.slope_mb_per_min == pytest.approx(6.0)
    assert g.kib_per_request == pytest.approx(6.0 * 1024 / (10.0 * 60))  # 10.24 KiB
    assert (g.first_mb, g.last_mb, g.peak_mb, g.flat) == (500.0, 603.0, 603.0, False)
    flat = growth("gateway", TIMES, [90.0, 99.0, 95.0, 95.0, math.nan, 95.0, 95.0], 1.0, 10.0)
    assert flat.slope_mb_per_min == 0.0 and flat.flat  # a missed sample (NaN) is left out of the fit
    assert math.isnan(growth("late", [0.0, 60.0], [1.0, 2.0], 1.0, 10.0).slope_mb_per_min)  # 1 point


def figures() -> dict[str, Any]:
    soak = SoakResult(60.0, 10.0, 8, 0.3, 1.0, requests={"completed": 450, "cancelled": 150},
                      times=TIMES, rss_mb={"engine": [500.0, 580.0, 560.0, 600.0, 601.0, 602.0, 603.0]},
                      pages_at_end=0.0, verdict="growing: engine", requests_per_s=10.0,
                      state_left={"gateway_inflight": 0.0, "pages_used": 0.0})  # fmt: skip
    soak.growth = [growth("engine", soak.times, soak.rss_mb["engine"], 1.0, requests_per_s=10.0)]
    return {
        "bad_input": {"tried": 41, "passed": 40, "failed": [], "state_left": {"pages_used": 0.0}},
        "http": {"tried": 19, "passed": 19, "failed": [], "disconnects": 8,
                 "disconnect_state_left": {"gateway_inflight": 0.0}, "state_left": {"detok_requests": 1.0},
                 "slow_headers": {"connections": 8, "closed": 8, "closed_after_s_max": 10.04},
                 "heavy": {"streams": 2, "n": 24, "tokens": 440, "events": [9000, 9100], "health_not_ok": 0,
                           "health": {"probes": 300, "p50_ms": 8.0, "p99_ms": 31.26, "max_ms": 90.0}},
                 "log_tracebacks": 0, "log_errors": 0},
        "abort_storm": StormResult(1000, {"decode": 250}, {"CANCELLED": 700, "completed": 300}, 9.0,
                                   {"pages_used": 0.0, "tombstones": 2.0}),  # fmt: skip
        "overload": OverloadResult(4, 7.0, 70.0, 210, 18, 190, 4.5, 31.0, 4.4, 5.6, {"CANCELLED": 2}),
        "overload_state_left": {"pages_used": 0.0},
        "soak": soak,
        "faults": [
            FaultResult("engine", 16, {"UNAVAILABLE": 15, "HUNG": 1}, 0.25, ["NOT_SERVING", "SERVING"],
                        True, True),
            FaultResult("tokenizer", 16, {"OK": 12, "UNAVAILABLE": 4}, 0.5, ["SERVING"], True, True),
        ],
    }  # fmt: skip


def test_report_rows_are_derived_from_the_results() -> None:
    rows = {(scenario, figure): value for scenario, figure, value in report_rows(figures())}
    assert rows[("bad input (gRPC)", "cases tried / passed")] == "41 / 40"
    assert rows[("bad input (gRPC)", "state left")] == "none"  # only zeros
    # The HTTP cases beside the gRPC ones.
    assert rows[("bad input (HTTP)", "cases tried / passed")] == "19 / 19"
    assert rows[("disconnects (HTTP)", "clients that left / state left")] == "8 / none"
    assert rows[("slow headers (HTTP)", "connections / closed by the server")] == (
        "8 / 8 (the last after 10.0 s)")
    assert rows[("heavy logprobs (HTTP)", "/health p50 / p99 / max beside them")] == (
        "8.0 / 31.3 / 90.0 ms (300 probes, 0 not 200; 2 streams of n 24 x 440 tokens, logprobs 20)")
    assert rows[("HTTP, all of it", "tracebacks / ERROR lines in the log / state left")] == (
        "0 / 0 / detok_requests 1")
    assert rows[("abort storm", "streams / cancelled / completed")] == "1,000 / 700 / 300"
    assert rows[("abort storm", "state left")] == "tombstones 2"  # the non-zero counts only
    assert rows[("overload", "offered")] == (
        "210 calls at 70.0/s (10.0x the sustained 7.0/s, --max-inflight 4)"
    )
    assert rows[("overload", "admitted / refused / other")] == "18 / 190 / {'CANCELLED': 2}"
    assert rows[("overload", "refusal latency p50 / max")] == "4.5 / 31.0 ms"
    assert rows[("soak", "RSS engine")] == (
        "500.0 -> 603.0 MiB, +6.00 MiB/min (2nd half), +10.24 KiB/request"
    )
    assert rows[("soak", "verdict")] == (
        "growing: engine (threshold 1 MiB/min; 60 s, 600 requests at 10.0/s)"
    )
    # Hung streams summed over the faults; each fault's own line.
    assert rows[("faults", "injected / streams hung")] == "2 SIGKILLs / 1 of 32"
    assert rows[("faults", "SIGKILL engine")] == (
        "{'UNAVAILABLE': 15, 'HUNG': 1}, broken streams ended in 0.25 s, "
        "health NOT_SERVING -> SERVING, restarted True, serves after True"
    )


def test_json_holds_every_result(tmp_path: Path) -> None:
    data = json.loads(write_json(tmp_path / "reliability.json", figures()).read_text())
    assert data["soak"]["growth"][0]["slope_mb_per_min"] == pytest.approx(6.0)
    assert data["faults"][1] == {
        "process": "tokenizer", "streams": 16, "outcomes": {"OK": 12, "UNAVAILABLE": 4},
        "seconds_to_end": 0.5, "health": ["SERVING"], "restarted": True, "serves_after": True,
    }  # fmt: skip
    assert data["overload"]["other"] == {"CANCELLED": 2}
