"""Overload: 10x the admission limit offered at once; the excess is refused fast with
RESOURCE_EXHAUSTED, the admitted streams keep their TPOT, and the server recovers."""

from __future__ import annotations

import asyncio

import pytest

from services.bench.reliability import overload
from tests.reliability.conftest import start

pytestmark = pytest.mark.timeout(150)
LIMIT = 4


def test_overload_is_refused_fast_and_recovers(tmp_path):
    pipe = start(tmp_path / "up.log", "--max-inflight", str(LIMIT))
    try:
        rss = pipe.rss_mb()["gateway"]
        result = asyncio.run(overload(pipe.target, LIMIT, factor=10))
        print(f"overload: {result}")
        assert result.admitted >= LIMIT and result.refused >= 8 * LIMIT and not result.other, result
        # The target is 50 ms (p50 11-15 ms measured here); the bound leaves room for a 2-core
        # machine saturated by parallel suites, where the client's own event loop adds ~100 ms.
        assert result.refusal_ms_p50 < 500, result
        assert result.tpot_ms_loaded < 2 * result.tpot_ms_unloaded, result
        assert pipe.rss_mb()["gateway"] < rss + 50
        pipe.wait_clean()
        assert pipe.client.generate("Once upon a time", max_tokens=3).completion_tokens == 3
    finally:
        pipe.stop()
