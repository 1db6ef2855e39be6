"""The soak, 60 seconds of it (pipeserve/bench/soak.py runs 10 minutes): steady mixed load with cancels on the
shared pipeline; the RSS of every process stays flat, and afterwards no KV page and no request state
is left anywhere."""

from __future__ import annotations

import asyncio

import pytest

from pipeserve.bench.soak import SHORT_THRESHOLD_MB_PER_MIN, default_threshold, growth, print_soak, soak

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(150)]
# The 60-s threshold, 3 MiB/min (SHORT_THRESHOLD_MB_PER_MIN). At the soak's 10 requests/s over 60 s,
# the second-half slopes measured here (5 runs, load average 0.8-5) were: tokenizers 0.2-0.9 MiB/min
# (their `tokenizers` BPE cache filling with distinct prompts, bounded at ~49 MiB), engine 0.1-0.6,
# gateway 0.0-0.5, detokenizer <= 0.15. One allocator step (~1 MiB, seen in the engine during
# 10-minute runs) landing in the 30-s half adds up to ~2 MiB/min, so 3 MiB/min is the lowest honest
# bound for 60 s. It fails a leak of >= 5 KiB per request; smaller leaks are the 10-minute script's
# job (1 MiB/min), and a leaked request record is caught exactly by the state counts asserted below.
THRESHOLD = SHORT_THRESHOLD_MB_PER_MIN


def test_growth_is_the_second_half_slope():
    times = [float(t) for t in range(0, 61, 2)]
    leak = growth("x", times, [100 + t / 10 for t in times], THRESHOLD, requests_per_s=10)
    assert leak.slope_mb_per_min == pytest.approx(6.0) and not leak.flat  # 6 MiB/min
    assert leak.kib_per_request == pytest.approx(6.0 * 1024 / 600)
    warm = growth("y", times, [100 + min(t, 20) for t in times], THRESHOLD, requests_per_s=10)
    assert warm.slope_mb_per_min == pytest.approx(0.0) and warm.flat  # warm-up, then flat
    assert (warm.first_mb, warm.last_mb, warm.peak_mb) == (100, 120, 120)


def test_soak_60s_is_flat_and_leaves_nothing(pipeline):
    result = asyncio.run(soak(pipeline, 60.0, rate=10.0))
    assert result.threshold_mb_per_min == THRESHOLD == default_threshold(60) == 3.0
    print_soak(result)
    assert set(result.requests) == {"completed", "cancelled"}, result.requests  # no errors
    assert result.requests["cancelled"] > 100 and result.requests_per_s > 8, result.requests
    assert len(result.times) >= 30 and len(result.growth) >= 6, result.growth  # every process sampled
    assert result.verdict == "flat", result.growth
    assert result.pages_at_end == 0 and not any(result.state_left.values()), result.state_left
