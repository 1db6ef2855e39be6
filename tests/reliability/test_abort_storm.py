"""Abort storm: 1,000 streams, each cancelled at a random point (before admission, in prefill,
mid-decode, after the last token); afterwards nothing is left in the gateway, the detokenizer or the
engine (requests, pages), and the server still serves."""

from __future__ import annotations

import asyncio

import pytest

from pipeserve.bench.reliability import PHASES, abort_storm

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(150)]


def test_abort_storm_leaves_no_state(pipeline):
    storm = asyncio.run(abort_storm(pipeline.target, streams=1000, concurrency=64, seed=1))
    assert all(storm.phases[p] > 150 for p in PHASES), storm.phases
    assert set(storm.outcomes) <= {"completed", "CANCELLED"}, storm.outcomes
    assert storm.outcomes.get("CANCELLED", 0) > 300, storm.outcomes
    left = pipeline.wait_clean(timeout=30)
    assert not any(left.values()), left
    assert pipeline.client.generate("Once upon a time", max_tokens=3, temperature=0).completion_tokens == 3
    pipeline.wait_clean()
    print(f"abort storm: {storm}")
