"""The gRPC gateway against a fake pipeline: the test plays tokenizer, engine and detokenizer on the
gateway's real ZeroMQ sockets and talks to it with real gRPC clients."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest
import uvloop
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pipeserve.config import Addresses, GatewayConfig, engine_endpoints
from pipeserve.detokenizer.openai_logprobs import Renderer
from pipeserve.gateway.client import AsyncClient, Client, build_request
from pipeserve.gateway.pb import generation_pb2 as pb
from pipeserve.gateway.server import Gateway
from pipeserve.local_cluster import scrape
from pipeserve.messages import (
    Abort,
    ChatMessage,
    EngineInfo,
    ModelInfo,
    ProcessStatus,
    RequestError,
    TextDeltas,
    TokenizeRequest,
    TokenLogprob,
    TopLogprob,
    WorkerReady,
    decode,
    encode,
    pack_ids,
    unpack_ids,
)
from pipeserve.sampling_params import MAX_STOP_STRINGS, PREEMPTIONS_BY_PRIORITY

pytestmark = pytest.mark.timeout(60)

INFO = ModelInfo(name="fake", context_length=512, vocab_size=512, eos_token_ids=[2], dtype="float32",
                 device="cpu", max_logprobs=5)


def render_logprobs(entries: list[Any], fmt: str) -> Any:
    """TokenLogprob entries rendered as the detokenizer renders them for an OpenAI format."""
    texts = {e.token_id: e.token for e in entries} | {t.token_id: t.token for e in entries for t in e.top}
    renderer = Renderer(texts)  # type: ignore[arg-type]  # any id -> text mapping
    pieces = renderer.pieces(fmt)
    for e in entries:
        top = e.top
        renderer.add(pieces, fmt, e.token_id, e.logprob, [t.token_id for t in top], [t.logprob for t in top])
    return pieces.message()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakePipeline:
    """A gateway in a background uvloop thread, and the test's side of its sockets (engines: how
    many engines it routes to; each gets its own control socket and heartbeats)."""

    def __init__(self, directory: str, engines: int = 1, **config: Any) -> None:
        self.addrs = Addresses.under(directory, engines)
        self.metrics_port = free_port()
        config = {"port": 0, "liveness_timeout": 1.0, "metrics_port": self.metrics_port, **config}
        self.loop = uvloop.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.gateway = Gateway(GatewayConfig(**config), self.addrs)
        self.port = self.run(self.gateway.start())
        self.target = f"127.0.0.1:{self.port}"
        self.client = Client(self.target)
        self.zmq = zmq.Context()
        # The test plays one tokenizer worker: a DEALER that announces itself, as worker.serve does.
        self.tokenize = self.zmq.socket(zmq.DEALER)
        self.tokenize.setsockopt(zmq.LINGER, 0)
        self.tokenize.setsockopt(zmq.ROUTING_ID, b"fake-worker")
        self.tokenize.connect(self.addrs.tokenize)
        self.tokenize.send(encode(WorkerReady("fake-worker")))
        self.queued: list[TokenizeRequest | Abort] = []  # read off the tokenize socket, not yet asked for
        self.deltas = self._socket(zmq.PUSH, self.addrs.deltas)
        self.errors = self._socket(zmq.PUSH, self.addrs.errors)
        self.status = self._socket(zmq.PUSH, self.addrs.status)
        self.controls = []
        for endpoint in engine_endpoints(self.addrs.control):
            self.controls.append(self.zmq.socket(zmq.PULL))
            self.controls[-1].bind(endpoint)
        self.control = self.controls[0]
        self.boots = [1] * engines
        self.silent: set[int] = set()  # engines whose heartbeats stopped
        self.completions: dict[str, int] = {}
        self.formats: dict[str, str] = {}  # rid -> the logprobs_format it was submitted with
        self.stats = {"running": 0, "pages_used": 0}
        self.per_engine: dict[int, dict[str, int]] = {}  # an engine's own counters, instead of stats
        self.beating = threading.Event()
        self.beating.set()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeats, daemon=True)
        self._beat.start()
        self.client.wait_ready(10)

    def _socket(self, kind: int, addr: str) -> zmq.Socket:
        sock = self.zmq.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        return sock

    def _heartbeats(self) -> None:
        """Engine (EngineInfo) and detokenizer (empty TextDeltas with stats) heartbeats, own sockets."""
        status, deltas = self._socket(zmq.PUSH, self.addrs.status), self._socket(zmq.PUSH, self.addrs.deltas)
        while not self._stop.wait(0.1):
            if self.beating.is_set():
                for engine, boot in enumerate(self.boots):
                    if engine not in self.silent:
                        stats = dict(self.per_engine.get(engine, self.stats))
                        status.send(encode(EngineInfo(boot=boot, info=INFO, stats=stats, engine=engine)))
                deltas.send(
                    encode(
                        TextDeltas(
                            rids=[],
                            text=[],
                            tokens=b"",
                            offsets=[0],
                            finish=[],
                            prompt_tokens=[],
                            completion_tokens=[],
                            cached_prompt_tokens=[],
                            stats={"detok_requests": 0},
                        )
                    )
                )
        status.close()
        deltas.close()

    @property
    def boot(self) -> int:
        return self.boots[0]

    @boot.setter
    def boot(self, value: int) -> None:
        self.boots[0] = value

    def run(self, coro: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _next_from_worker(self, kind: type, timeout: float) -> Any:
        """The next message of kind the gateway sent this worker (others read meanwhile are kept)."""
        deadline = time.monotonic() + timeout
        while True:
            for msg in self.queued:
                if isinstance(msg, kind):
                    self.queued.remove(msg)
                    return msg
            left = deadline - time.monotonic()
            if left <= 0 or not self.tokenize.poll(int(left * 1000)):
                return None
            self.queued.append(decode(self.tokenize.recv()))

    def next_request(self, timeout: float = 30) -> TokenizeRequest:
        msg = self._next_from_worker(TokenizeRequest, timeout)
        assert msg is not None, "no TokenizeRequest arrived"
        self.formats.update(dict.fromkeys(msg.engine_rids(), msg.logprobs_format))
        return msg

    def next_abort(self, timeout: float = 5, engine: int = 0, via: str = "control") -> Abort:
        """The next Abort for engine: via "control" (a request the engine holds: its output came) or
        via "worker" (through the tokenizer worker that took the add, which forwards it behind it)."""
        if via == "worker":
            msg = self._next_from_worker(Abort, timeout)
            assert msg is not None and msg.engine == engine, "no Abort arrived through the worker"
            return msg
        assert self.controls[engine].poll(int(timeout * 1000)), "no Abort arrived"
        msg = decode(self.controls[engine].recv())
        assert isinstance(msg, Abort)
        return msg

    def send(self, rows: list[tuple[str, str, list[int], str]], logprobs: list[Any] | None = None) -> None:
        """rows of (rid, text, ids, finish), as one TextDeltas (completion_tokens counts each rid's
        ids so far, as the detokenizer does)."""
        offsets = np.cumsum([0] + [len(r[2]) for r in rows]).tolist()
        for r in rows:
            self.completions[r[0]] = self.completions.get(r[0], 0) + len(r[2])
        # As the detokenizer does: the rows of a request with an OpenAI logprobs format go rendered.
        rendered = [None] * len(rows)
        for i, r in enumerate(rows):
            fmt = self.formats.get(r[0], "")
            if logprobs is not None and logprobs[i] is not None and fmt:
                rendered[i] = render_logprobs(logprobs[i], fmt)
                logprobs = [None if j == i else entries for j, entries in enumerate(logprobs)]
        self.deltas.send(
            encode(
                TextDeltas(
                    rids=[r[0] for r in rows],
                    text=[r[1] for r in rows],
                    tokens=pack_ids([i for r in rows for i in r[2]]),
                    offsets=offsets,
                    finish=[r[3] for r in rows],
                    prompt_tokens=[3] * len(rows),
                    completion_tokens=[self.completions[r[0]] for r in rows],
                    cached_prompt_tokens=[2] * len(rows),
                    logprobs=logprobs if logprobs and any(lp is not None for lp in logprobs) else None,
                    logprobs_json=rendered if any(lp is not None for lp in rendered) else None,
                )
            )
        )

    def metric(self, name: str) -> float:
        return scrape(self.metrics_port)[name]

    def wait(self, predicate: Any, timeout: float = 5) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "condition not reached"
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._beat.join()
        self.client.close()
        self.run(self.gateway.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.zmq.destroy(linger=0)


@pytest.fixture
def fake(tmp_path):
    pipeline = FakePipeline(str(tmp_path))
    yield pipeline
    pipeline.close()


def rpc_error(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    return info.value


def test_stream_roundtrip_and_request_fields(fake):
    call = fake.client.stream(
        "Hello",
        request_id="r1",
        max_tokens=7,
        temperature=0.7,
        top_k=5,
        seed=11,
        stop=["."],
        logprobs=2,
        app="chat",
        cache_salt="tenant-a",
        speculative=False,
        priority=-3,
    )
    req = fake.next_request()
    assert req.sampling.speculative is False and req.sampling.priority == -3
    assert (req.rid, req.prompt, req.app, req.cache_salt) == ("r1", "Hello", "chat", "tenant-a")
    assert req.sampling.max_tokens == 7 and req.sampling.temperature == 0.7  # exact: doubles on the wire
    sampling = req.sampling
    assert (sampling.top_k, sampling.seed, sampling.stop, sampling.logprobs) == (5, 11, ["."], 2)
    assert req.sampling.top_p == 1.0  # unset fields take the defaults
    top = TokenLogprob(7, "Hi", -0.1, [TopLogprob(7, "Hi", -0.1), TopLogprob(8, "Ho", -2.5)])
    fake.send([("r1", "Hi", [7], "")], logprobs=[[top]])
    first = next(call)
    assert (first.request_id, first.text, list(first.token_ids), first.finish_reason) == ("r1", "Hi", [7], "")
    assert first.logprobs[0].token_id == 7 and [t.token_id for t in first.logprobs[0].top] == [7, 8]
    assert (first.logprobs[0].top[1].token, first.logprobs[0].top[1].logprob) == ("Ho", -2.5)
    fake.send([("r1", " there", [9, 10], "length")])
    last = next(call)
    assert (last.text, list(last.token_ids), last.finish_reason) == (" there", [9, 10], "length")
    usage = last.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (3, 3, 2)
    assert list(call) == []
    fake.wait(lambda: fake.metric("pipeserve_gateway_inflight") == 0)
    assert fake.metric('pipeserve_gateway_requests_total{outcome="length"}') == 1
    assert fake.metric('pipeserve_engine{name="running"}') == 0
    fake.stats.update(spec_draft_tokens=12, spec_accepted_tokens=5, spec_verifications=4)
    fake.stats[PREEMPTIONS_BY_PRIORITY + "-1"] = 3
    drafts = 'pipeserve:spec_decode_num_draft_tokens_total{engine="0"}'
    fake.wait(lambda: scrape(fake.metrics_port).get(drafts) == 12)  # the next heartbeat
    assert fake.metric('pipeserve:num_preemptions_by_priority_total{engine="0",priority="-1"}') == 3
    assert fake.metric('pipeserve:spec_decode_num_accepted_tokens_total{engine="0"}') == 5
    assert fake.metric('pipeserve:spec_decode_num_drafts_total{engine="0"}') == 4


def test_ids_and_chat_inputs_and_assigned_ids(fake):
    call = fake.client.stream([5, 6, 7], max_tokens=2)
    req = fake.next_request()
    assert unpack_ids(req.prompt_ids).tolist() == [5, 6, 7] and req.prompt is None
    assert len(req.rid) == 32  # assigned: uuid4 hex
    fake.send([(req.rid, "x", [1], "stop")])
    assert [c.request_id for c in call] == [req.rid]
    call = fake.client.stream([{"role": "user", "content": "hi"}])
    req = fake.next_request()
    assert req.messages == [ChatMessage("user", "hi")]
    fake.send([(req.rid, "", [], "stop")])
    assert [c.finish_reason for c in call] == ["stop"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 2**31]}, "prompt_token_ids"),  # not an int32; the vocabulary is the tokenizer's
        ({"prompt": []}, "prompt_token_ids"),
        ({"prompt": "x", "temperature": -1.0}, "temperature"),
        ({"prompt": "x", "top_p": 0.0}, "top_p"),
        ({"prompt": "x", "top_k": 0}, "top_k"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "logprobs": 6}, "logprobs"),  # the engine allows 5 (INFO)
        ({"prompt": "x", "seed": 2**63}, "seed"),
        ({"prompt": "x", "stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"prompt": "x" * (5 * 1024 * 1024)}, "prompt"),  # over max_request_bytes (4 MiB)
        ({"prompt": "x", "request_id": "r" * 300}, "request_id"),
        ({"prompt": "x", "cache_salt": "s" * 300}, "cache_salt"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(fake, kwargs, field):
    prompt = kwargs.pop("prompt")
    err = rpc_error(fake.client.stream(prompt, timeout=10, **kwargs))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.details()
    assert fake.tokenize.poll(50) == 0  # nothing reached the pipeline
    call = fake.client.stream("still serving")
    fake.send([(fake.next_request().rid, "ok", [1], "stop")])
    assert [c.text for c in call] == ["ok"]


def test_missing_input_and_empty_messages(fake):
    for request in (pb.GenerateRequest(), pb.GenerateRequest(messages=pb.ChatMessages())):
        err = rpc_error(fake.client.stub.Generate(request, timeout=5))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt" in err.details() or "messages" in err.details()


def test_admission_limit_and_duplicate_ids(tmp_path):
    fake = FakePipeline(str(tmp_path), max_inflight=2)
    try:
        calls = [fake.client.stream("x", request_id=f"a{i}") for i in range(2)]
        rids = {fake.next_request().rid for _ in calls}
        assert rids == {"a0", "a1"}
        assert (
            rpc_error(fake.client.stream("x", request_id="a2")).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        fake.send([("a0", "", [], "stop")])
        list(calls[0])
        dup = rpc_error(fake.client.stream("x", request_id="a1"))
        assert dup.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id" in dup.details()
        fake.send([("a1", "", [], "stop")])
        list(calls[1])
        assert fake.metric('pipeserve_gateway_requests_total{outcome="RESOURCE_EXHAUSTED"}') == 1
    finally:
        fake.close()


def test_cancel_aborts_in_engine_and_reserves_the_id_until_the_engine_confirms(fake):
    call = fake.client.stream("x", request_id="c1", max_tokens=100)
    fake.next_request()
    fake.send([("c1", "a", [1], "")])
    assert next(call).text == "a"
    call.cancel()
    abort = fake.next_abort()
    assert abort.rids == ["c1"]
    fake.wait(lambda: fake.metric("pipeserve_gateway_inflight") == 0)
    fake.send([("c1", "late", [2], "")])  # in flight before the engine saw the abort: dropped
    assert rpc_error(fake.client.stream("x", request_id="c1")).code() == grpc.StatusCode.ALREADY_EXISTS
    fake.send([("c1", "", [], "abort")])  # the engine's confirmation frees the id
    fake.wait(lambda: fake.metric("pipeserve_gateway_aborting") == 0)
    again = fake.client.stream("x", request_id="c1")
    assert fake.next_request().rid == "c1"
    fake.send([("c1", "b", [3], "stop")])
    assert [c.text for c in again] == ["b"]


def test_output_for_no_stream_is_aborted_once(fake):
    """An engine that runs a request nobody streams (its abort was lost, e.g. with a dead engine's
    queue) is told to stop, once; its finish frees the id."""
    fake.send([("ghost", "a", [1], "")])
    assert fake.next_abort().rids == ["ghost"]
    fake.wait(lambda: fake.metric("pipeserve_gateway_aborting") == 1)
    fake.send([("ghost", "b", [2], "")])
    fake.send([("ghost", "", [], "abort")])
    fake.wait(lambda: fake.metric("pipeserve_gateway_aborting") == 0)
    assert not fake.control.poll(200), "aborted twice"


def test_deadline_is_honoured_and_aborted(fake):
    call = fake.client.stream("x", request_id="d1", timeout=0.5)
    fake.next_request()
    assert rpc_error(call).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert fake.next_abort(via="worker").rids == ["d1"]
    fake.wait(lambda: fake.metric("pipeserve_gateway_inflight") == 0)


def test_abort_rpc_ends_the_stream(fake):
    call = fake.client.stream("x", request_id="ab")
    fake.next_request()
    assert fake.client.abort("ab") is True
    assert fake.next_abort(via="worker").rids == ["ab"]
    chunks = list(call)
    assert chunks[-1].finish_reason == "abort"
    assert fake.client.abort("ab") is False and fake.client.abort("nobody") is False


def test_slow_client_gets_coalesced_deltas(fake):
    call = fake.client.stream("x", request_id="slow")
    fake.next_request()
    fake.send([("slow", "0", [0], "")])
    assert next(call).text == "0"
    for i in range(1, 200):  # the client reads nothing meanwhile
        fake.send([("slow", str(i % 10), [i], "")])
    fake.send([("slow", "", [], "length")])
    time.sleep(0.3)
    rest = list(call)
    assert len(rest) < 20
    assert "".join(c.text for c in rest) == "".join(str(i % 10) for i in range(1, 200))
    assert [t for c in rest for t in c.token_ids] == list(range(1, 200))
    assert rest[-1].finish_reason == "length"


def test_large_backlog_is_cut_into_bounded_messages(tmp_path):
    fake = FakePipeline(str(tmp_path), max_response_bytes=4096)
    try:
        call = fake.client.stream("x", request_id="big")
        fake.next_request()
        fake.send([("big", "y" * 100, [i], "") for i in range(100)] + [("big", "", [], "stop")])
        chunks = list(call)
        assert len(chunks) > 5 and all(c.ByteSize() < 8192 for c in chunks)
        assert "".join(c.text for c in chunks) == "y" * 10_000
    finally:
        fake.close()


def test_request_errors_map_to_status_codes(fake):
    call = fake.client.stream("too long", request_id="e1")
    fake.next_request()
    fake.errors.send(encode(RequestError(rid="e1", code="INVALID_ARGUMENT", message="prompt has 900 tokens")))
    err = rpc_error(call)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in err.details()
    call = fake.client.stream("x", request_id="e2")
    fake.next_request()
    fake.errors.send(encode(RequestError(rid="e2", code="NO_SUCH_CODE", message="boom")))
    assert rpc_error(call).code() == grpc.StatusCode.INTERNAL
    assert fake.control.poll(100) == 0  # rejected before the engine ran them: nothing to abort


def test_malformed_messages_are_dropped(fake):
    call = fake.client.stream("x", request_id="m1")
    fake.next_request()
    fake.deltas.send(b"\x00garbage")
    fake.errors.send(encode(Abort(rids=["m1"])))  # valid message, wrong socket
    fake.status.send(encode(RequestError(rid="m1", code="INTERNAL", message="x")))  # errors only on `errors`
    fake.errors.send(encode(ProcessStatus(process="engine", up=False)))  # status only on `status`
    fake.deltas.send(
        encode(
            TextDeltas(
                rids=["m1"],
                text=["a"],
                tokens=pack_ids([1]),
                offsets=[0, 5],
                finish=[""],
                prompt_tokens=[1],
                completion_tokens=[1],
                cached_prompt_tokens=[0],
            )
        )
    )
    fake.send([("m1", "ok", [1], "stop")])
    assert [c.text for c in call] == ["ok"]


def test_health_reflection_and_model_info(fake):
    health = health_pb2_grpc.HealthStub(fake.client.channel)
    for service in ("", "pipeserve.v1.Generation"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    db = ProtoReflectionDescriptorDatabase(fake.client.channel)
    assert "pipeserve.v1.Generation" in db.get_services()
    assert "grpc.health.v1.Health" in db.get_services()
    info = fake.client.model_info()
    assert (info.name, info.context_length, info.vocab_size, list(info.eos_token_ids)) == (
        "fake",
        512,
        512,
        [2],
    )
    assert info.max_logprobs == 5


def test_not_serving_until_heartbeats(tmp_path):
    addrs = Addresses.under(str(tmp_path))
    loop = uvloop.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    gateway = Gateway(GatewayConfig(port=0, liveness_timeout=1.0), addrs)
    port = asyncio.run_coroutine_threadsafe(gateway.start(), loop).result(10)
    client = Client(f"127.0.0.1:{port}")
    try:
        assert client.health() == "NOT_SERVING"
        assert rpc_error(client.stream("x")).code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as info:
            client.model_info()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        client.close()
        asyncio.run_coroutine_threadsafe(gateway.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_engine_down_fails_streams_until_it_is_back(fake):
    call = fake.client.stream("x", request_id="k1")
    fake.next_request()
    fake.send([("k1", "a", [1], "")])
    next(call)
    fake.status.send(encode(ProcessStatus(process="engine", up=False)))
    err = rpc_error(call)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "engine" in err.details()
    fake.wait(lambda: fake.client.health() == "NOT_SERVING")
    assert rpc_error(fake.client.stream("x")).code() == grpc.StatusCode.UNAVAILABLE
    assert fake.next_abort().rids == ["k1"]  # for its successor: adds still on the way get dropped
    fake.boot = 2
    fake.status.send(encode(ProcessStatus(process="engine", up=True)))
    fake.client.wait_ready(5)


def test_detokenizer_down_aborts_streams_in_the_engine(fake):
    call = fake.client.stream("x", request_id="z1")
    fake.next_request()
    fake.status.send(encode(ProcessStatus(process="detokenizer", up=False)))
    assert rpc_error(call).code() == grpc.StatusCode.UNAVAILABLE
    assert fake.next_abort(via="worker").rids == ["z1"]


def test_tokenizer_down_fails_only_requests_without_output(fake):
    started = fake.client.stream("x", request_id="t1")
    waiting = fake.client.stream("x", request_id="t2")
    fake.next_request(), fake.next_request()
    fake.send([("t1", "a", [1], "")])
    assert next(started).text == "a"
    fake.status.send(encode(ProcessStatus(process="tokenizer-1", up=False)))
    assert rpc_error(waiting).code() == grpc.StatusCode.UNAVAILABLE
    assert fake.next_abort(via="worker").rids == ["t2"]
    assert fake.client.health() == "SERVING"
    fake.send([("t1", "b", [2], "stop")])
    assert [c.text for c in started] == ["b"]


def test_engine_restart_seen_through_heartbeats(fake):
    call = fake.client.stream("x", request_id="b1")
    fake.next_request()
    fake.boot = 3  # compose: no supervisor, a new boot id in the heartbeat
    err = rpc_error(call)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "restarted" in err.details()


def test_silent_pipeline_turns_not_serving(fake):
    call = fake.client.stream("x", request_id="s1")
    fake.next_request()
    fake.beating.clear()
    assert rpc_error(call).code() == grpc.StatusCode.UNAVAILABLE
    assert fake.client.health() == "NOT_SERVING"
    assert fake.next_abort(via="worker").rids == ["s1"]
    fake.beating.set()
    fake.client.wait_ready(5)


def test_async_client(fake):
    async def scenario() -> None:
        async with AsyncClient(fake.target) as client:
            assert await client.health() == "SERVING"
            task = asyncio.create_task(client.generate("hi", request_id="as1", max_tokens=3))
            await asyncio.sleep(0)
            req = await asyncio.to_thread(fake.next_request)
            await asyncio.to_thread(fake.send, [(req.rid, "x", [1], ""), (req.rid, "y", [2], "length")])
            completion = await task
            assert (completion.text, completion.token_ids, completion.finish_reason) == (
                "xy",
                [1, 2],
                "length",
            )
            assert (await client.model_info()).name == "fake"
            assert await client.abort("none") is False

    asyncio.run(scenario())


def test_build_request_shapes():
    assert build_request("x", max_tokens=None).HasField("max_tokens") is False
    assert build_request([]).WhichOneof("input") == "prompt_token_ids"
    assert build_request([{"role": "user", "content": "c"}]).messages.messages[0].content == "c"


def test_healthcheck_probe(fake):
    from pipeserve.gateway import healthcheck

    assert healthcheck.main(["grpc", fake.target]) == 0
    assert healthcheck.main(["tcp", fake.target]) == 0
    assert healthcheck.main(["tcp", f"127.0.0.1:{free_port()}"]) == 1
    assert healthcheck.main(["grpc", f"127.0.0.1:{free_port()}"]) == 1
    assert healthcheck.main(["http", fake.target]) == 2


def test_committed_pb_modules_match_the_proto(tmp_path):
    """A fresh clone needs no codegen step, so the committed modules must be current (`make proto`)."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    from pipeserve.gateway.proto import PROTO_ROOT, PROTOS

    out = tmp_path / "set.pb"
    assert protoc.main(["protoc", f"-I{PROTO_ROOT}", f"--descriptor_set_out={out}", *PROTOS]) == 0
    (fresh,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    messages = list(fresh.message_type)
    while messages:  # the python plugin leaves json_name out of what it embeds (map entries included)
        message = messages.pop()
        messages.extend(message.nested_type)
        for f in message.field:
            f.ClearField("json_name")
    assert descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb) == fresh


def test_requests_go_to_the_tokenizer_workers_in_turn_and_skip_one_that_left(fake):
    other = fake.zmq.socket(zmq.DEALER)
    other.setsockopt(zmq.LINGER, 0)
    other.setsockopt(zmq.ROUTING_ID, b"other")
    other.connect(fake.addrs.tokenize)
    other.send(encode(WorkerReady("other")))
    fake.wait(lambda: len(fake.gateway.core.workers) == 2)
    calls = [fake.client.stream("x", request_id=f"w{i}") for i in range(2)]
    assert other.poll(5000), "the second worker got nothing"
    assert {fake.next_request().rid, decode(other.recv()).rid} == {"w0", "w1"}  # one each
    calls[1].cancel()  # not started: its abort goes to the worker that took it, whichever it was
    other.close()

    async def gone() -> bool:  # once the gateway's socket saw the disconnect, a send to it fails
        return not fake.gateway.core._to_worker(b"other", b"")

    fake.wait(lambda: fake.run(gone()))
    assert fake.gateway.core.workers == [b"fake-worker"]
    more = [fake.client.stream("y", request_id=f"y{i}") for i in range(3)]
    assert sorted(fake.next_request().rid for _ in more) == ["y0", "y1", "y2"]  # all to the one left
    for rid in ("w0", "y0", "y1", "y2"):
        fake.send([(rid, "", [], "stop")])
    assert [list(c)[-1].finish_reason for c in [calls[0], *more]] == ["stop"] * 4


def test_without_a_tokenizer_worker_the_gateway_is_not_serving(tmp_path):
    fake = FakePipeline(str(tmp_path))
    try:
        fake.tokenize.close()

        async def gone() -> bool:
            return not fake.gateway.core._to_worker(b"fake-worker", b"")

        fake.wait(lambda: fake.run(gone()))
        fake.wait(lambda: fake.client.health() == "NOT_SERVING")
        err = rpc_error(fake.client.stream("x"))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "tokenizer" in err.details()
    finally:
        fake.close()
