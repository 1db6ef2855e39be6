"""The engine process loop around a recording fake engine, over real (inproc) ZeroMQ sockets: wire
conversion of the engine's plain updates, aborts in order with their adds, clocks, heartbeats (with
the engine's counters) on the status socket."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np
import pytest
import zmq

from pipeserve.engine import process
from pipeserve.engine.process import EngineLoop, step_output
from pipeserve.engine.sequence import Sequence, StepUpdate, TokenLogprobs
from pipeserve.messages import (
    Abort,
    EngineInfo,
    EngineRequest,
    MessageError,
    RequestError,
    StepLogprobs,
    StepOutput,
    decode,
    encode,
    pack_ids,
    unpack_ids,
)
from pipeserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(30)


@dataclass
class FakeConfig:
    max_logprobs: int = 7
    tensor_parallel_size: int = 1  # the heartbeat reports it


class FakeEngine:
    """Each running request gets one token (7) per step until max_tokens. Like Engine, it asserts
    instead of validating; prompts longer than 10 ids do not fit."""

    def __init__(self) -> None:
        self.config = FakeConfig()
        self.calls: list[tuple] = []
        self.requests: dict[str, Sequence] = {}
        self.left: dict[str, int] = {}
        self.ended: list[str] = []
        self.step_count = 0

    def model_info(self) -> dict:
        return {"name": "fake", "context_length": 64, "vocab_size": 100, "eos_token_ids": [2]}

    def take_refused(self) -> dict[str, str]:
        return {}

    def capacity_problem(self, prompt_len: int) -> str | None:
        return f"prompt has {prompt_len} tokens, more than the KV cache holds" if prompt_len > 10 else None

    def add(self, rid, prompt_ids, params, app="", arrival=None, cache_salt="", embed=False,
            lora=None) -> None:
        assert params.temperature >= 0, "unvalidated params"
        self.calls.append(("add", rid, prompt_ids, app, arrival))
        self.requests[rid] = Sequence(rid, list(prompt_ids), len(prompt_ids), params, arrival or 0.0, app,
                                      cache_salt)
        self.left[rid] = params.max_tokens

    def abort(self, rid, reason="abort") -> bool:
        self.calls.append(("abort", rid, reason))
        if rid not in self.requests:
            return False
        if self.left.pop(rid, None) is not None:
            self.requests[rid].finish_reason = reason
            self.ended.append(rid)
        return True

    def has_work(self) -> bool:
        return bool(self.left or self.ended)

    def step(self) -> list[StepUpdate]:
        self.step_count += 1
        self.calls.append(("step",))
        updates = []
        for rid in list(self.left):
            self.left[rid] -= 1
            seq = self.requests[rid]
            seq.finish_reason = "" if self.left[rid] else "length"
            updates.append(StepUpdate(seq, [7], seq.finish_reason, None, not seq.announced))
            if not self.left[rid]:
                del self.left[rid]
        updates += [StepUpdate(self.requests[rid], [], "abort", None, not self.requests[rid].announced)
                    for rid in self.ended]
        self.ended = []
        for u in updates:
            u.seq.announced = True
            if u.finish_reason:
                del self.requests[u.rid]
        return updates

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
            ("status", zmq.PUSH, zmq.PULL),
        ):
            mine, theirs = self.ctx.socket(kind), self.ctx.socket(peer)
            mine.bind(f"inproc://{name}")
            theirs.connect(f"inproc://{name}")
            socks[name] = mine
            setattr(self, name, theirs)
        self.engine = FakeEngine()
        self.loop = EngineLoop(self.engine, heartbeat=heartbeat, **socks)

    def request(self, rid: str, ids: list[int], arrival: float = 0.0, cache_salt: str = "",
                **sampling) -> None:
        params = SamplingParams(**sampling)
        self.requests.send(encode(EngineRequest(rid=rid, prompt_ids=pack_ids(ids), sampling=params,
                                                arrival=arrival, cache_salt=cache_salt)))

    def received(self, sock: zmq.Socket) -> list:
        out = []
        while sock.poll(50):
            out.append(decode(sock.recv()))
        return out

    def settle(self) -> None:
        """Let inproc messages land, then run one iteration."""
        time.sleep(0.05)
        self.loop.once()

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def h():
    harness = Harness()
    yield harness
    harness.close()


def test_drains_everything_queued_then_aborts_then_steps(h):
    h.loop.once()  # the first heartbeat
    h.received(h.steps), h.received(h.status)
    for i in range(5):
        h.request(f"r{i}", [1, 2], max_tokens=3, cache_salt=f"t{i % 2}")
    h.control.send(encode(Abort(rids=["r1", "ghost"], reason="stop")))
    time.sleep(0.05)
    h.engine.calls.clear()
    h.loop.once()
    assert [h.engine.requests[rid].cache_salt for rid in ("r0", "r3")] == ["t0", "t1"]
    assert [c[:2] for c in h.engine.calls] == [("add", f"r{i}") for i in range(5)] + [
        ("abort", "r1"),
        ("abort", "ghost"),
        ("step",),
    ]
    assert h.engine.calls[5][2] == "stop"
    (out,) = h.received(h.steps)
    assert out.rids == ["r0", "r2", "r3", "r4", "r1"] and out.finish[-1] == "abort"
    assert unpack_ids(out.tokens).tolist() == [7, 7, 7, 7, -1]
    assert [n.rid for n in out.new] == out.rids  # every request's first step announces it
    # the counters travel in the heartbeat only (the next is 10 s away); "finished" counts this
    # engine's completed requests
    assert h.received(h.status) == [] and h.loop.stats() == {"running": 4, "steps": 1, "finished": 1}
    while h.engine.has_work():
        h.loop.once()
    outs = h.received(h.steps)
    assert [o.step for o in outs] == [2, 3] and outs[-1].finish == ["length"] * 4
    assert all(o.new == [] for o in outs)


def record_polls(h, monkeypatch, clock: list[float] | None = None) -> list[int]:
    """The timeout (ms) of every poll the loop makes; with `clock` (process.time.monotonic's value),
    a poll that finds nothing advances it by its timeout, as a real one blocks that long."""
    timeouts: list[int] = []
    poll = h.loop.poller.poll

    def recorded(timeout: int):
        timeouts.append(timeout)
        ready = poll(0)
        if clock is not None and not ready:
            clock[0] += timeout / 1000
        return ready

    monkeypatch.setattr(h.loop.poller, "poll", recorded)
    if clock is not None:
        monkeypatch.setattr(process.time, "monotonic", lambda: clock[0])
    return timeouts


def test_busy_loop_never_blocks_on_input(h, monkeypatch):
    h.request("long", [1], max_tokens=50)
    time.sleep(0.05)
    timeouts = record_polls(h, monkeypatch)
    for _ in range(50):
        h.loop.once()
    assert timeouts == [0] * 50  # heartbeat is 10 s: a blocking poll would wait for it
    assert len(h.received(h.steps)) == 50


def test_bad_and_malformed_requests_never_stop_the_loop(h):
    h.request("unvalidated", [1], temperature=-1.0)  # the gateway's job: here an assertion, INTERNAL
    h.request("long", list(range(11)))  # only the engine knows its pool: the client's error
    h.requests.send(b"\x93garbage")
    h.requests.send(encode(StepOutput(step=0, rids=[], tokens=b"", finish=[])))  # valid, on the wrong socket
    h.control.send(encode(EngineRequest(rid="y", prompt_ids=pack_ids([1]), sampling=SamplingParams())))
    h.requests.send(encode(EngineRequest(rid="odd", prompt_ids=b"\x01\x02\x03", sampling=SamplingParams())))
    h.request("fine", [1], max_tokens=1)
    h.settle()
    errors = h.received(h.errors)
    assert all(isinstance(e, RequestError) for e in errors)
    assert {e.rid: e.code for e in errors} == {
        "unvalidated": "INTERNAL",
        "long": "INVALID_ARGUMENT",
        "odd": "INVALID_ARGUMENT",
    }
    assert "KV cache" in next(e.message for e in errors if e.rid == "long")
    assert [c[1] for c in h.engine.calls if c[0] == "add"] == ["fine"]  # the fake records after its assert
    status = h.received(h.status)
    assert status and all(isinstance(m, EngineInfo) for m in status)


def test_idle_heartbeats_go_to_the_status_socket(monkeypatch):
    h = Harness(heartbeat=0.2)
    try:
        timeouts = record_polls(h, monkeypatch, clock=[1000.0])
        for _ in range(3):
            h.loop.once()
        # Idle: the first beat at once, then each poll blocks until the next heartbeat is due.
        assert timeouts == [0, pytest.approx(200, abs=1), pytest.approx(200, abs=1)]  # ms, rounded up
        steps, infos = h.received(h.steps), h.received(h.status)
        assert len(steps) == 3 and all(s.rids == [] for s in steps)
        assert len(infos) == 3 and all(isinstance(i, EngineInfo) for i in infos)
        assert all(i.stats == {"running": 0, "steps": 0, "finished": 0} for i in infos)
        assert infos[0].info.max_logprobs == 7 and infos[0].info.name == "fake"
        assert len({i.boot for i in infos}) == 1
        assert h.received(h.errors) == []  # request failures only
    finally:
        h.close()


def test_wall_clock_arrival_becomes_monotonic(h):
    h.request("a", [1], arrival=time.time() - 2.0)
    h.request("b", [1])
    h.settle()
    adds = {c[1]: c[4] for c in h.engine.calls if c[0] == "add"}
    assert adds["a"] == pytest.approx(time.monotonic() - 2.0, abs=0.3)
    assert adds["b"] is None


# -- aborts: behind their adds, nothing kept for ids the engine does not hold -----------------------

def test_an_abort_behind_its_add_ends_it_at_once(h):
    """A tokenizer forwards the gateway's abort on the socket that carried the add: it comes after
    the add, in the same drain, and the request ends at the next step without a token."""
    h.request("late", [1, 5, 6], max_tokens=5)
    h.requests.send(encode(Abort(rids=["late"])))
    h.settle()
    assert [c[:2] for c in h.engine.calls] == [("add", "late"), ("abort", "late"), ("step",)]
    (out,) = [s for s in h.received(h.steps) if s.rids]
    assert (out.rids, unpack_ids(out.tokens).tolist(), out.finish) == (["late"], [-1], ["abort"])
    assert [n.rid for n in out.new] == ["late"]  # announced, so the detokenizer reports the finish
    assert not h.engine.has_work()


def test_an_abort_for_an_id_the_engine_does_not_hold_leaves_nothing_behind(h):
    """The engine keeps no memory of aborts it could not apply: a later request with that id (a
    reused client id) runs normally."""
    h.control.send(encode(Abort(rids=["ghost"])))
    h.requests.send(encode(Abort(rids=["ghost"])))
    h.settle()
    h.request("ghost", [1, 5], max_tokens=2)
    h.settle()
    while h.engine.has_work():
        h.loop.once()
    finish = {rid: f for s in h.received(h.steps) for rid, f in zip(s.rids, s.finish, strict=True) if f}
    assert finish == {"ghost": "length"}


def test_an_abort_of_a_finished_request_changes_nothing(h):
    h.request("done", [1, 5], max_tokens=1)
    h.settle()
    assert not h.engine.has_work()
    h.control.send(encode(Abort(rids=["done"])))
    h.settle()
    assert not h.engine.has_work() and [s for s in h.received(h.steps) if s.rids][-1].finish == ["length"]


# -- wire conversion --------------------------------------------------------------------------------

def test_step_output_is_the_wire_form_of_the_updates():
    prompt = list(range(1, 13))
    a = Sequence("a", prompt + [40], len(prompt), SamplingParams(stop=["x"], logprobs=2), 0.0)
    b = Sequence("b", [5, 6], 2, SamplingParams(skip_special_tokens=False), 0.0)
    c = Sequence("c", [9], 1, SamplingParams(), 0.0)
    d = Sequence("d", [9, 10], 2, SamplingParams(logprobs=0), 0.0)
    lp = TokenLogprobs(-0.25, np.array([40, 41]), np.array([-0.25, -1.5], dtype=np.float32))
    lp_d = TokenLogprobs(-3.0, np.array([], dtype=np.int64), np.array([], dtype=np.float32))
    updates = [StepUpdate(a, [40], "", [lp], new=True), StepUpdate(b, [7], "length", new=True),
               StepUpdate(c, [], "abort"), StepUpdate(d, [11], "", [lp_d])]
    a.num_cached_tokens = 8
    out = decode(encode(step_output(12, updates)))
    assert isinstance(out, StepOutput) and out.step == 12
    assert (out.rids, unpack_ids(out.tokens).tolist(), out.finish) == (["a", "b", "c", "d"], [40, 7, -1, 11],
                                                                      ["", "length", "abort", ""])
    na, nb = out.new  # what only the engine knows; stop strings and the like go tokenizer -> detokenizer
    assert (na.rid, na.cached_prompt_tokens, nb.rid, nb.cached_prompt_tokens) == ("a", 8, "b", 0)
    # Columns over the rows: b and c did not ask (-1, NaN), d asked for its token's logprob alone (0).
    assert out.logprobs is not None
    lps, counts, top_ids, top_lps, starts = out.logprobs.rows(4)
    assert counts == [2, -1, -1, 0] and lps[0] == -0.25 and lps[3] == -3.0 and all(map(math.isnan, lps[1:3]))
    assert (top_ids, top_lps, starts) == ([40, 41], [-0.25, -1.5], [0, 2, 2, 2, 2])
    with pytest.raises(MessageError):
        out.logprobs.rows(3)  # columns of 4 rows in a step of 3
    short = StepLogprobs(out.logprobs.logprobs, out.logprobs.counts, out.logprobs.top_ids[:4],
                         out.logprobs.top_logprobs)
    with pytest.raises(MessageError):
        short.rows(4)  # 2 top entries counted, 1 sent
    assert step_output(3, [StepUpdate(c, [], "abort")]).logprobs is None  # nobody asked


def test_engine_threads_leave_a_core_for_the_other_processes(monkeypatch):
    from pipeserve.config import EngineConfig
    from pipeserve.engine.process import engine_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(2)))
    assert engine_threads(EngineConfig(device="cpu")) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)))
    assert engine_threads(EngineConfig(device="cpu")) == 15
    assert engine_threads(EngineConfig(device="cpu", cpu_threads=3)) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(1)))
    assert engine_threads(EngineConfig(device="cpu")) == 1
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(cpu_threads=-1)
