"""Overload: calls offered at 10x the rate the server sustains; the excess is refused fast with
RESOURCE_EXHAUSTED, the admitted streams keep their TPOT, memory stays bounded and the server
recovers."""

from __future__ import annotations

import asyncio

import pytest

from pipeserve.bench.reliability import overload
from tests.reliability.conftest import start

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(150)]
LIMIT = 4


def test_overload_is_refused_fast_and_recovers(tmp_path):
    pipe = start(tmp_path / "up.log", "--max-inflight", str(LIMIT))
    try:
        rss = pipe.rss_mb()["gateway"]
        # Streams long enough that 10x the sustained rate stays a few hundred calls/s: with the native
        # step a 128-token stream ends so soon that 10x its rate is more calls than 2 cores can even
        # accept, and refusal latency would time the CPU queue instead of the gateway.
        result = asyncio.run(overload(pipe.target, LIMIT, factor=10, max_tokens=384, seconds=3.0))
        print(f"overload: {result}")
        assert result.offered_per_s > 5 * result.sustained_per_s, result  # the client kept up, roughly
        assert result.admitted >= LIMIT and result.refused >= 8 * LIMIT and not result.other, result
        # The gateway refuses before any field check, ~0.2 ms of its CPU per refusal. p50 measured
        # here: ~1 ms idle, 3-8 ms with four busy loops saturating the 2 cores (load average ~8).
        assert result.refusal_ms_p50 < 50, result
        # The max is one unlucky call. Measured: 6-44 ms idle, 31-38 ms under the busy loops; but on
        # 2 cores shared with other suites a process can be descheduled for several 100 ms (engine
        # steps stretched to ~900 ms in the bench runs; 670 ms seen here once at 3x this call rate).
        assert result.refusal_ms_max < 1000, result
        assert result.tpot_ms_loaded < 2 * result.tpot_ms_unloaded, result
        assert pipe.rss_mb()["gateway"] < rss + 50
        pipe.wait_clean()
        assert pipe.client.generate("Once upon a time", max_tokens=3).completion_tokens == 3
    finally:
        pipe.stop()
