"""The engine process loop around a recording fake engine, over real (inproc) ZeroMQ sockets."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
import zmq

from services.engine.process import EngineLoop
from services.messages import (
    Abort,
    EngineInfo,
    EngineRequest,
    RequestError,
    StepOutput,
    decode,
    encode,
    pack_ids,
)
from services.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(30)


@dataclass
class FakeConfig:
    max_logprobs: int = 7


class FakeEngine:
    """Each running request gets one token per step until max_tokens."""

    def __init__(self) -> None:
        self.config = FakeConfig()
        self.calls: list[tuple] = []
        self.left: dict[str, int] = {}
        self.ended: list[str] = []
        self.step_count = 0

    def model_info(self) -> dict:
        return {"name": "fake", "context_length": 64, "vocab_size": 100, "eos_token_ids": [2]}

    def add(self, rid, prompt_ids, params, app="", arrival=None) -> None:
        params.validate()
        if max(prompt_ids) >= 100:
            raise ValueError("prompt_token_ids must be in [0, 100)")
        self.calls.append(("add", rid, prompt_ids, app, arrival))
        self.left[rid] = params.max_tokens

    def abort(self, rid, reason="abort") -> None:
        self.calls.append(("abort", rid, reason))
        if self.left.pop(rid, None) is not None:
            self.ended.append(rid)

    def has_work(self) -> bool:
        return bool(self.left or self.ended)

    def step(self) -> StepOutput:
        self.step_count += 1
        self.calls.append(("step",))
        rids, tokens, finish = [], [], []
        for rid in list(self.left):
            self.left[rid] -= 1
            rids.append(rid), tokens.append(7), finish.append("" if self.left[rid] else "length")
            if not self.left[rid]:
                del self.left[rid]
        for rid in self.ended:
            rids.append(rid), tokens.append(-1), finish.append("abort")
        self.ended = []
        return StepOutput(step=self.step_count, rids=rids, tokens=pack_ids(tokens), finish=finish)

    def stats(self) -> dict[str, int]:
        return {"running": len(self.left), "steps": self.step_count}


class Harness:
    def __init__(self, heartbeat: float = 10.0) -> None:
        self.ctx = zmq.Context()
        socks = {}
        for name, kind, peer in (
            ("requests", zmq.PULL, zmq.PUSH),
            ("control", zmq.PULL, zmq.PUSH),
            ("steps", zmq.PUSH, zmq.PULL),
            ("errors", zmq.PUSH, zmq.PULL),
        ):
            mine, theirs = self.ctx.socket(kind), self.ctx.socket(peer)
            mine.bind(f"inproc://{name}")
            theirs.connect(f"inproc://{name}")
            socks[name] = mine
            setattr(self, name, theirs)
        self.engine = FakeEngine()
        self.loop = EngineLoop(self.engine, heartbeat=heartbeat, **socks)

    def request(self, rid: str, ids: list[int], arrival: float = 0.0, **sampling) -> None:
        params = SamplingParams(**sampling).to_dict()
        self.requests.send(
            encode(EngineRequest(rid=rid, prompt_ids=pack_ids(ids), sampling=params, arrival=arrival))
        )

    def received(self, sock: zmq.Socket) -> list:
        out = []
        while sock.poll(50):
            out.append(decode(sock.recv()))
        return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def h():
    harness = Harness()
    yield harness
    harness.close()


def test_drains_everything_queued_then_aborts_then_steps(h):
    h.loop.once()  # the first heartbeat
    h.received(h.steps), h.received(h.errors)
    for i in range(5):
        h.request(f"r{i}", [1, 2], max_tokens=3)
    h.control.send(encode(Abort(rids=["r1", "ghost"], reason="stop")))
    time.sleep(0.05)
    h.engine.calls.clear()
    h.loop.once()
    assert [c[:2] for c in h.engine.calls] == [("add", f"r{i}") for i in range(5)] + [
        ("abort", "r1"),
        ("abort", "ghost"),
        ("step",),
    ]
    assert h.engine.calls[5][2] == "stop"
    (out,) = h.received(h.steps)
    assert out.rids == ["r0", "r2", "r3", "r4", "r1"] and out.finish[-1] == "abort"
    assert out.stats == {"running": 4, "steps": 1}  # every step carries the counters
    while h.engine.has_work():
        h.loop.once()
    outs = h.received(h.steps)
    assert [o.step for o in outs] == [2, 3] and outs[-1].finish == ["length"] * 4
    assert outs[-1].stats["running"] == 0


def test_busy_loop_never_blocks_on_input(h):
    h.request("long", [1], max_tokens=50)
    time.sleep(0.05)
    start = time.monotonic()
    for _ in range(50):
        h.loop.once()
    assert time.monotonic() - start < 2.0  # heartbeat is 10 s: a blocking poll would show
    assert len(h.received(h.steps)) == 50


def test_bad_and_malformed_requests_never_stop_the_loop(h):
    h.request("bad", [1], temperature=-1.0)
    h.request("vocab", [500])
    h.requests.send(b"\x93garbage")
    h.requests.send(encode(Abort(rids=["x"])))  # a valid message on the wrong socket
    h.control.send(encode(EngineRequest(rid="y", prompt_ids=pack_ids([1]), sampling={})))
    h.request("unknown", [1], max_tokens=1)
    h.requests.send(encode(EngineRequest(rid="weird", prompt_ids=pack_ids([1]), sampling={"nope": 1})))
    time.sleep(0.05)
    h.loop.once()
    errors = [m for m in h.received(h.errors) if isinstance(m, RequestError)]
    assert {e.rid: e.code for e in errors} == {
        "bad": "INVALID_ARGUMENT",
        "vocab": "INVALID_ARGUMENT",
        "weird": "INVALID_ARGUMENT",
    }
    assert "temperature" in next(e.message for e in errors if e.rid == "bad")
    assert "prompt_token_ids" in next(e.message for e in errors if e.rid == "vocab")
    assert [c[1] for c in h.engine.calls if c[0] == "add"] == ["unknown"]


def test_idle_heartbeats_carry_info_and_stats():
    h = Harness(heartbeat=0.2)
    try:
        start = time.monotonic()
        for _ in range(3):
            h.loop.once()
        assert 0.3 < time.monotonic() - start < 1.5  # idle: blocks until the next heartbeat is due
        steps, infos = h.received(h.steps), h.received(h.errors)
        assert len(steps) == 3 and all(s.rids == [] and s.stats == {"running": 0, "steps": 0} for s in steps)
        assert len(infos) == 3 and all(isinstance(i, EngineInfo) for i in infos)
        assert infos[0].info["max_logprobs"] == 7 and infos[0].info["name"] == "fake"
        assert len({i.boot for i in infos}) == 1
    finally:
        h.close()


def test_wall_clock_arrival_becomes_monotonic(h):
    h.request("a", [1], arrival=time.time() - 2.0)
    h.request("b", [1])
    time.sleep(0.05)
    h.loop.once()
    adds = {c[1]: c[4] for c in h.engine.calls if c[0] == "add"}
    assert adds["a"] == pytest.approx(time.monotonic() - 2.0, abs=0.3)
    assert adds["b"] is None


def test_engine_threads_leave_a_core_for_the_other_processes(monkeypatch):
    from services.config import EngineConfig
    from services.engine.process import engine_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(2)))
    assert engine_threads(EngineConfig(device="cpu")) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)))
    assert engine_threads(EngineConfig(device="cpu")) == 15
    assert engine_threads(EngineConfig(device="cpu", cpu_threads=3)) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(1)))
    assert engine_threads(EngineConfig(device="cpu")) == 1
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(cpu_threads=-1)
