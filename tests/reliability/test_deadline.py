"""A request whose gRPC deadline passes is aborted in the engine within one step."""

from __future__ import annotations

import grpc
import pytest

pytestmark = pytest.mark.timeout(60)


def test_deadline_aborts_in_the_engine_within_one_step(pipeline):
    call = pipeline.client.stream("Once upon a time", max_tokens=400, ignore_eos=True, timeout=1.5)
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    at_deadline = pipeline.state()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    steps = pipeline.metrics()['pipeserve_engine{name="steps"}']
    left = pipeline.wait_clean(timeout=10)
    after = pipeline.metrics()['pipeserve_engine{name="steps"}']
    # The stats lag the engine by up to one step, so a step in flight plus the boundary: at most 2.
    assert after - steps <= 2, (steps, after, at_deadline, left)
