"""Data parallelism without a model: the router's choice (load, prefix affinity), the gateway with two
fake engines (routing, per-engine failures, health, ModelInfo and metrics), the detokenizer's
per-engine state, the launcher's plan."""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc
import numpy as np
import pytest

from pipeserve.config import Addresses, EngineConfig, GatewayConfig, engine_endpoint, engine_endpoints
from pipeserve.cpus import CpuSplit, engine_core_sets
from pipeserve.detokenizer.worker import Detokenizer, Row
from pipeserve.gateway.health import engine_index
from pipeserve.gateway.router import BLOCK_CHARS, Router, prefix_blocks
from pipeserve.launcher import plan
from pipeserve.messages import ProcessStatus, StepOutput, encode, pack_ids
from tests.test_detokenizer import new, told
from tests.test_gateway import FakePipeline, rpc_error

pytestmark = pytest.mark.timeout(60)

LONG = "You are a helpful assistant. Answer briefly and never make anything up. " * 3


def live_router(engines: int = 2, threshold: int = 8) -> Router:
    router = Router(engines, threshold)
    for view in router.engines:
        view.live = True
    return router


# ---- the router ------------------------------------------------------------------------------------
def test_prefix_blocks_chain_whole_blocks_of_the_leading_prompt() -> None:
    a = prefix_blocks("", text=LONG + "What is 2 + 2? " * 8)
    b = prefix_blocks("", text=LONG + "Name a colour. " * 8)
    assert len(a) == len(LONG + "What is 2 + 2? " * 8) // BLOCK_CHARS
    shared = len(LONG) // BLOCK_CHARS
    assert a[:shared] == b[:shared] and a[shared:] != b[shared:]
    assert prefix_blocks("tenant-b", text=LONG)[0] != prefix_blocks("", text=LONG)[0]  # salts never share
    assert prefix_blocks("", text="short") == []  # no whole block: no affinity
    ids = np.arange(40)
    assert len(prefix_blocks("", ids=ids, page=16)) == 2  # whole pages only
    assert prefix_blocks("", ids=ids, page=16)[0] == prefix_blocks("", ids=np.arange(16), page=16)[0]


def test_least_loaded_by_waiting_x4_plus_running_and_bursts_spread() -> None:
    router = live_router(3)
    router.report(0, {"waiting": 1, "running": 0})  # load 4
    router.report(1, {"waiting": 0, "running": 3})  # load 3
    router.report(2, {"waiting": 0, "running": 5})  # load 5
    assert router.pick([]) == 1
    # The request just routed counts as waiting at engine 1 until its next heartbeat: load 7.
    assert router.pick([]) == 0  # 4 < 5 < 7
    assert router.pick([]) == 2  # 8 > 5
    router.report(1, {"waiting": 0, "running": 0})  # settles what was routed to it
    assert router.pick([]) == 1
    assert [v.routed for v in router.engines] == [1, 2, 1]
    # A request with n = 3 queues three engine requests there: 4 x (1 + 3).
    assert router.pick([], copies=3) == 1 and router.engines[1].load() == 16


def test_prefix_affinity_unless_much_busier_and_never_to_a_dead_engine() -> None:
    router = live_router(2, threshold=8)
    blocks = prefix_blocks("", text=LONG + "first")
    first = router.pick(blocks)
    assert first == 0
    router.report(0, {"waiting": 1, "running": 2})  # load 6 vs 0: within the threshold
    assert router.pick(prefix_blocks("", text=LONG + "second")) == 0  # the shared leading blocks win
    assert router.pick([]) == 1  # no prefix: least loaded
    router.report(0, {"waiting": 3, "running": 2})  # load 14 vs 4 (one routed to 1)
    assert router.pick(prefix_blocks("", text=LONG + "third")) == 1  # much busier: balance wins
    # The prefix now belongs to engine 1, where it went last.
    router.report(0, {})
    router.engines[1].live = False
    assert router.pick(prefix_blocks("", text=LONG + "fourth")) == 0
    router.forget(0)
    assert all(owner != 0 for owner in router.owners.values())


# ---- addresses and the launcher's plan -------------------------------------------------------------
def test_one_requests_and_control_endpoint_per_engine(tmp_path) -> None:
    addrs = Addresses.under(str(tmp_path), engines=3)
    assert engine_endpoints(addrs.requests) == [f"ipc://{tmp_path}/requests-{i}" for i in range(3)]
    assert engine_endpoint(addrs.control, 2) == f"ipc://{tmp_path}/control-2"
    assert engine_endpoint("tcp://*:5551", 1) == "tcp://*:5551"  # compose: each engine its own address
    assert engine_endpoints(Addresses.under(str(tmp_path)).requests) == [f"ipc://{tmp_path}/requests-0"]
    assert [engine_index(n) for n in ("engine", "engine-0", "engine-3", "detokenizer", "tokenizer-1")] == [
        0, 0, 3, None, None]


def test_plan_starts_one_engine_per_replica_on_its_own_cores(monkeypatch) -> None:
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(5)))
    children = plan(EngineConfig(model="m", device="cpu"), GatewayConfig(), workers=1, engines=2)
    engines = [c for c in children if c.argv[0] == "engine"]
    assert [c.name for c in engines] == ["engine-0", "engine-1"]
    assert [c.argv[c.argv.index("--engine-index") + 1] for c in engines] == ["0", "1"]
    assert [c.env["PIPESERVE_CPUS"] for c in engines] == ["1,2", "3,4"]
    assert [c.argv[c.argv.index("--cpu-threads") + 1] for c in engines] == ["2", "2"]
    assert engine_core_sets(CpuSplit((1,), (0,)), 2) == [(1,), (1,)]  # fewer cores than engines: shared
    assert engine_core_sets(CpuSplit((1, 2, 3), (0,)), 2) == [(1, 2), (3,)]


# ---- the detokenizer -------------------------------------------------------------------------------
def test_detokenizer_sends_stop_aborts_to_the_engine_and_forgets_only_a_restarted_engine(stories) -> None:
    det = Detokenizer(stories)
    ids = stories.encode(" the end. more")
    rows: dict[str, Row] = {}
    det.settings(dataclasses.replace(told("a", stories, "Once", stop=["end"]), engine=1), rows)
    det.settings(told("b", stories, "Once"), rows)
    first = StepOutput(5, ["a"], pack_ids([ids[0]]), [""], [new("a")], engine=1)
    other = StepOutput(9, ["b"], pack_ids([ids[0]]), [""], [new("b")], engine=0)
    assert det.process(first, rows) == [] and det.process(other, rows) == []
    stopped = []
    for token in ids[1:]:
        stopped += det.process(StepOutput(6, ["a"], pack_ids([token]), [""], engine=1), rows)
    assert stopped == [(1, "a")]  # the abort goes to engine 1, which runs "a"
    # Engine 0 restarts (its step count starts over): only its requests are dropped.
    det.requests["a2"] = dataclasses.replace(det.requests["b"], engine=1)
    det.settings(told("c", stories, "Hi"), rows)
    det.process(StepOutput(1, ["c"], pack_ids([ids[0]]), [""], [new("c")], engine=0), rows)
    assert set(det.requests) == {"a2", "c"}
    assert det.deltas(rows).row_engines == [1, 0, 0]  # a (stopped), b (its row before the restart), c


@pytest.fixture
def stories(stories_dir):
    from pipeserve.tokenizer.load import load_tokenizer

    return load_tokenizer(stories_dir)


# ---- the gateway with two engines ------------------------------------------------------------------
@pytest.fixture
def fake2(tmp_path):
    pipeline = FakePipeline(str(tmp_path), engines=2, dp_balance_threshold=8)
    yield pipeline
    pipeline.close()


def test_gateway_routes_by_reported_load_and_keeps_a_prefix_together(fake2) -> None:
    fake2.per_engine[0] = {"running": 4, "waiting": 2, "pages_used": 0}  # load 12
    fake2.wait(lambda: fake2.gateway.core.router.engines[0].load() == 12)
    first = fake2.client.stream(LONG + "one", request_id="p1")
    assert fake2.next_request().engine == 1
    # Engine 1 is busier now, but within the threshold (7 vs 0): the prefix keeps to it; a request
    # without a shared prefix goes to the least loaded.
    fake2.per_engine = {0: {"running": 0, "waiting": 0}, 1: {"running": 7, "waiting": 0}}
    fake2.wait(lambda: [v.load() for v in fake2.gateway.core.router.engines] == [0, 7])
    second = fake2.client.stream(LONG + "two", request_id="p2")
    assert fake2.next_request().engine == 1
    third = fake2.client.stream("a short prompt", request_id="p3")
    assert fake2.next_request().engine == 0
    fourth = fake2.client.stream("another", request_id="p4")
    assert fake2.next_request().engine == 0
    assert fake2.client.abort("p4")  # the Abort RPC reaches the engine running it, only that one
    assert fake2.next_abort(engine=0, via="worker").rids == ["p4"]  # through the worker, to engine 0
    assert not fake2.controls[0].poll(200) and not fake2.controls[1].poll(200)
    assert [r.finish_reason for r in fourth][-1] == "abort"
    fake2.send([("p1", "a", [1], "stop"), ("p2", "b", [2], "stop"), ("p3", "c", [3], "stop"),
                ("p4", "", [], "abort")])
    assert [r.text for r in first] == ["a"] and [r.text for r in second] == ["b"]
    assert [r.text for r in third] == ["c"]
    assert fake2.metric('pipeserve_gateway_routed_requests_total{engine="1"}') == 2
    assert fake2.metric('pipeserve_engine_stat{engine="1",name="running"}') == 7
    assert fake2.metric('pipeserve_engine{name="running"}') == 7  # summed over the engines
    assert fake2.metric('pipeserve_topology{data_parallel_size="2",tensor_parallel_size="1"}') == 1
    info = fake2.client.model_info()
    assert (info.data_parallel_size, info.tensor_parallel_size) == (2, 1)
    fake2.wait(lambda: fake2.gateway.core.router.engines[1].load() == 7)
    engines = fake2.client.model_info().engines
    assert [(e.index, e.serving, e.running, e.waiting, e.routed) for e in engines] == [
        (0, True, 0, 0, 2), (1, True, 7, 0, 2)]


def stream_on(fake2: FakePipeline, engine: int, rid: str) -> Any:
    """A stream the router sends to `engine`: the other engine reports a queue, this one none."""
    loads = {engine: 0, 1 - engine: 20}
    fake2.per_engine = {engine: {"running": 0, "waiting": 0}, 1 - engine: {"running": 0, "waiting": 5}}
    fake2.wait(lambda: all(fake2.gateway.core.router.engines[i].load() == load for i, load in loads.items()))
    call = fake2.client.stream("x", request_id=rid)
    assert fake2.next_request().engine == engine
    return call


def test_one_engine_down_fails_only_its_streams_and_its_aborts_go_to_it(fake2) -> None:
    on1, on0 = stream_on(fake2, 1, "e1"), stream_on(fake2, 0, "e0")
    fake2.send([("e0", "a", [1], ""), ("e1", "b", [2], "")])
    next(on0), next(on1)
    fake2.status.send(encode(ProcessStatus(process="engine-1", up=False)))
    err = rpc_error(on1)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "the engine 1 died" in err.details()
    assert fake2.next_abort(engine=1).rids == ["e1"]
    assert not fake2.controls[0].poll(200)  # nothing aborted on engine 0
    assert fake2.client.health() == "SERVING"
    fake2.per_engine[1] = {"running": 0, "waiting": 0}  # idle, but down: new requests go to engine 0
    again = fake2.client.stream("y", request_id="n1")
    assert fake2.next_request().engine == 0
    fake2.send([("e0", "c", [3], "stop"), ("n1", "d", [4], "stop")])
    assert "".join(r.text for r in on0) == "c" and [r.text for r in again] == ["d"]
    fake2.boots[1] = 2
    fake2.status.send(encode(ProcessStatus(process="engine-1", up=True)))
    fake2.wait(lambda: fake2.gateway.core.router.engines[1].live)
    last = stream_on(fake2, 1, "n2")  # back, and taking requests
    fake2.send([("n2", "e", [5], "stop")])
    assert [r.text for r in last] == ["e"]


def test_an_engine_that_stops_beating_loses_its_streams_the_others_serve_on(fake2) -> None:
    call = stream_on(fake2, 1, "s1")
    fake2.silent.add(1)
    err = rpc_error(call)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "engine 1" in err.details()
    assert fake2.client.health() == "SERVING"
    fake2.silent.add(0)
    fake2.wait(lambda: fake2.client.health() == "NOT_SERVING")
    fake2.silent.clear()
    fake2.client.wait_ready(5)


def test_a_restarted_engine_fails_only_its_old_streams(fake2) -> None:
    on1, on0 = stream_on(fake2, 1, "r1"), stream_on(fake2, 0, "r0")
    fake2.boots[1] = 7  # engine 1 restarted without a supervisor (compose)
    assert rpc_error(on1).code() == grpc.StatusCode.UNAVAILABLE
    fake2.send([("r0", "ok", [1], "stop")])
    assert [r.text for r in on0] == ["ok"]


def test_launch_flags_are_checked_before_anything_starts(monkeypatch) -> None:
    import argparse
    import importlib.util

    from pipeserve.launcher import add_arguments, launch_config
    from pipeserve.preflight import StartupError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert launch_config(parser.parse_args(["--data-parallel-size", "3"])).data_parallel_size == 3
    with pytest.raises(StartupError, match="--data-parallel-size must be >= 1"):
        launch_config(parser.parse_args(["--data-parallel-size", "0"]))
    args = parser.parse_args(["--ray", "auto"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(StartupError, match=r"pip install 'pipeserve\[ray\]'"):
        launch_config(args)


def test_output_for_no_stream_is_aborted_in_the_engine_running_it(fake2) -> None:
    from pipeserve.messages import TextDeltas

    fake2.deltas.send(encode(TextDeltas(rids=["ghost"], text=["x"], tokens=pack_ids([1]), offsets=[0, 1],
                                        finish=[""], prompt_tokens=[1], completion_tokens=[1],
                                        cached_prompt_tokens=[0], row_engines=[1])))
    assert fake2.next_abort(engine=1).rids == ["ghost"]
    assert not fake2.controls[0].poll(200)  # a tombstone there could end a later request reusing the id
