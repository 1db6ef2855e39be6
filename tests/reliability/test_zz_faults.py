"""Process faults under load (runs last: it kills processes of the shared pipeline). SIGKILL a
tokenizer, the detokenizer and the engine in turn while 16 streams run: every stream ends (completed
or UNAVAILABLE) within 5 s, the supervisor restarts the process, health goes NOT_SERVING (pipeline
processes) and back to SERVING, and new requests succeed. tests/test_pipeline.py covers the
single-stream cases and the tokenizer's lost queue; this adds load and the time bound."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from services.gateway.client import AsyncClient

pytestmark = pytest.mark.timeout(240)


async def fault_under_load(pipeline, name: str) -> tuple[float, dict[str, int], list[str]]:
    """Seconds from the kill until the last broken (UNAVAILABLE) stream ended, outcomes, health seen
    after the kill. Streams the fault did not break (a tokenizer's started ones) run to completion."""
    async with AsyncClient(pipeline.target) as client:
        calls = [client.stream("Once upon a time", max_tokens=48, ignore_eos=True) for _ in range(16)]
        for call in calls[:4]:
            await call.read()
        victim = pipeline.pids(name)[0]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()

        async def drain(call) -> tuple[str, float]:
            try:
                while (await call.read()) is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code().name, time.monotonic() - killed
            return "OK", time.monotonic() - killed

        results = await asyncio.wait_for(asyncio.gather(*(drain(c) for c in calls)), timeout=90)
        ends = [code for code, _ in results]
        took = max((t for code, t in results if code != "OK"), default=0.0)
        seen = [await client.health()]
        deadline = time.monotonic() + 90
        while seen[-1] != "SERVING" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            status = await client.health()
            if status != seen[-1]:
                seen.append(status)
        assert victim not in pipeline.pids(name)
        outcomes = {code: ends.count(code) for code in set(ends)}
        return took, outcomes, seen


@pytest.mark.parametrize("name", ["tokenizer", "detokenizer", "engine"])
def test_sigkill_under_load(pipeline, name):
    took, outcomes, seen = asyncio.run(fault_under_load(pipeline, name))
    print(f"SIGKILL {name}: streams ended in {took:.2f} s {outcomes}, health {seen}")
    assert took < 5.0 and set(outcomes) <= {"OK", "UNAVAILABLE"}, (took, outcomes)
    assert seen[-1] == "SERVING"
    if name != "tokenizer":
        assert seen[0] == "NOT_SERVING" and outcomes.get("UNAVAILABLE") == 16
    assert pipeline.client.generate("Once upon a time", max_tokens=3, temperature=0).completion_tokens == 3
    # Known gap: the broken streams' abort confirmations die with the process, so the gateway keeps
    # their ids reserved until ABORTED_TTL and a new engine keeps their tombstones (both bounded).
    pipeline.wait(lambda: not any(v for k, v in pipeline.state().items()
                                  if k not in ("gateway_aborting", "tombstones")), 30, "idle pipeline")
    left = pipeline.state()
    assert left["gateway_aborting"] <= 3 * 16 and left["tombstones"] <= 16, left  # the faults so far
