"""Process faults under load (runs last: it kills processes of the shared pipeline). SIGKILL a
tokenizer, the detokenizer and the engine in turn while 16 streams run: every stream ends (completed
or UNAVAILABLE) within 5 s, none hangs, the supervisor restarts the process, health goes NOT_SERVING
(pipeline processes) and back to SERVING, and new requests succeed. tests/test_pipeline.py covers the
single-stream cases and the tokenizer's lost queue; this adds load and the time bound. The scenario
is bench.reliability.fault_under_load, which `pipeserve bench reliability` reports."""

from __future__ import annotations

import asyncio

import pytest

from pipeserve.bench.reliability import FAULT_PROCESSES, fault_under_load

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(240)]


@pytest.mark.parametrize("name", FAULT_PROCESSES)
def test_sigkill_under_load(pipeline, name):
    fault = asyncio.run(fault_under_load(pipeline, name, streams=16))
    print(f"SIGKILL {name}: {fault}")
    assert fault.seconds_to_end < 5.0 and set(fault.outcomes) <= {"OK", "UNAVAILABLE"}, fault
    assert fault.health[-1] == "SERVING" and fault.restarted and fault.serves_after, fault
    if name != "tokenizer":
        assert fault.health[0] == "NOT_SERVING" and fault.outcomes.get("UNAVAILABLE") == 16, fault
    # Known gap: the confirmations of the broken streams that had started die with the process, so the
    # gateway keeps their ids reserved until ABORTED_HOLD (60 s), bounded. (Those not started yet are
    # confirmed: their aborts follow their adds to the new engine, which ends them at once.)
    pipeline.wait(lambda: not any(v for k, v in pipeline.state().items() if k != "gateway_aborting"), 30,
                  "idle pipeline")
    left = pipeline.state()
    assert left["gateway_aborting"] <= 3 * 16, left  # the faults so far
