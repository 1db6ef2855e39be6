"""End to end: `pipeserve up --data-parallel-size 2` on stories260K (two real engines behind one
gateway), real gRPC clients: every request completes with the single engine's greedy output, both
engines take a fair share, and a SIGKILLed engine fails only its own streams and comes back."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pipeserve.gateway.client import Completion
from pipeserve.local_cluster import LocalCluster
from tests.conftest import STORIES
from tests.test_pipeline import BASES, stream_all

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not (STORIES / "config.json").is_file(), reason=f"stories260K not found at {STORIES}"),
]

ROUTED = 'pipeserve_gateway_routed_requests_total{{engine="{}"}}'


@pytest.fixture(scope="module")
def dp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_path = tmp_path_factory.mktemp("pipeserve-dp") / "up.log"
    with LocalCluster(log_path, str(STORIES), "--data-parallel-size", "2", workers=2, startup=120) as srv:
        srv.wait_engines(2)
        yield srv


def engine_pids(cluster: LocalCluster) -> dict[int, int]:
    """engine index -> pid, from the process titles ("pipeserve: engine 1")."""
    out = {}
    for pid, sub in cluster.children().items():
        title = Path(f"/proc/{pid}/cmdline").read_text().split("\0")[0]
        if sub == "engine" and title.startswith("pipeserve: engine "):
            out[int(title.rsplit(" ", 1)[1])] = pid
    return out


def routed(cluster: LocalCluster) -> list[float]:
    metrics = cluster.metrics()
    return [metrics[ROUTED.format(i)] for i in range(2)]


def test_200_concurrent_requests_complete_on_both_engines_with_the_single_engine_output(dp2) -> None:
    from pipeserve.engine import LLM, SamplingParams

    info = dp2.client.model_info()
    assert (info.data_parallel_size, info.tensor_parallel_size, len(info.engines)) == (2, 1, 2)
    assert sorted(engine_pids(dp2)) == [0, 1]
    prompts = [f"{BASES[i % 8]} {i}" for i in range(200)]
    max_tokens = [4 + i % 9 for i in range(200)]
    before = routed(dp2)
    results = asyncio.run(stream_all(dp2.target, [
        {"prompt": p, "max_tokens": m, "temperature": 0, "request_id": f"dp-{i}"}
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ]))
    # One engine in this process: what --data-parallel-size 1 serves (test_pipeline checks that).
    llm = LLM(str(STORIES), device="cpu")
    expected = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens])
    for i, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert isinstance(got, Completion), f"stream {i}: {got}"
        assert (got.token_ids, got.text, got.finish_reason) == (
            want.token_ids, want.text, want.finish_reason), i
    share = [after - b for after, b in zip(routed(dp2), before, strict=True)]
    assert sum(share) == 200 and min(share) >= 60, share  # both engines served a fair share
    dp2.wait_idle()

    def finished_per_engine() -> list[float]:
        metrics = dp2.metrics()
        return [metrics[f'pipeserve_engine_stat{{engine="{i}",name="finished"}}'] for i in range(2)]

    # The engines' counters reach the gateway with their heartbeats: wait for the ones after the last finish.
    dp2.wait(lambda: sum(finished_per_engine()) >= 200, 10, "the engines' finished counters")
    finished = finished_per_engine()
    assert sum(finished) >= 200 and min(finished) >= 60, finished  # the engines' own counters agree


def test_sigkill_one_engine_fails_only_its_streams_and_it_returns(dp2) -> None:
    pids = engine_pids(dp2)
    before = routed(dp2)

    async def scenario() -> tuple[list[Completion | grpc.RpcError], list[str]]:
        requests = [{"prompt": f"{BASES[i % 8]} kill {i}", "max_tokens": 400, "ignore_eos": True,
                     "temperature": 0} for i in range(16)]
        health: list[str] = []
        task = asyncio.ensure_future(stream_all(dp2.target, requests))
        # Both engines run streams once each has been routed half of them and the first tokens flow.
        while sum(routed(dp2)) - sum(before) < 16 or dp2.engine("running") < 16:
            await asyncio.sleep(0.05)
        os.kill(pids[1], signal.SIGKILL)
        while not task.done():
            health.append(dp2.client.health())
            await asyncio.sleep(0.05)
        return task.result(), health

    results, health = asyncio.run(scenario())
    share = [after - b for after, b in zip(routed(dp2), before, strict=True)]
    failed = [r for r in results if isinstance(r, grpc.RpcError)]
    done = [r for r in results if isinstance(r, Completion)]
    assert all(e.code() == grpc.StatusCode.UNAVAILABLE and "engine 1" in e.details() for e in failed)
    assert len(failed) == share[1] and len(done) == share[0] >= 1, (len(failed), share)
    assert all(c.completion_tokens == 400 and c.finish_reason == "length" for c in done)
    assert set(health) == {"SERVING"}  # engine 0 served on throughout
    # The launcher restarts it, and it takes requests again.
    dp2.wait(lambda: dp2.metrics()['pipeserve_engine_serving{engine="1"}'] == 1, 90, "engine 1 back")
    assert engine_pids(dp2)[1] != pids[1] and engine_pids(dp2)[0] == pids[0]
    again = routed(dp2)
    results = asyncio.run(stream_all(dp2.target, [
        {"prompt": f"after {i}", "max_tokens": 4, "temperature": 0} for i in range(8)]))
    assert all(isinstance(r, Completion) and r.completion_tokens == 4 for r in results)
    assert routed(dp2)[1] > again[1]
    dp2.wait_idle()
