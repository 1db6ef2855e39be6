"""The bad-input table over gRPC: each case gets its status code and a message naming the field;
afterwards the server still serves and holds no request state and no pages."""

from __future__ import annotations

import asyncio

import pytest

from pipeserve.bench.reliability import run_bad_inputs

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(120)]


def test_bad_input_table(pipeline):
    results = asyncio.run(run_bad_inputs(pipeline.target))
    assert len(results) >= 25
    failed = [r for r in results if not r.passed]
    assert not failed, "\n".join(f"{r.name}: wanted {r.expected}, got {r.code}: {r.details}" for r in failed)
    pipeline.wait_clean()
    assert pipeline.client.generate("Once upon a time", max_tokens=3, temperature=0).completion_tokens == 3
    pipeline.wait_clean()
