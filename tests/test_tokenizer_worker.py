"""The tokenizer worker: prompt / chat / id requests to EngineRequests, the length rules, errors that
name the field, and two worker processes over real ZeroMQ sockets."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from typing import Any

import msgpack
import pytest
import zmq

from pipeserve.messages import (
    PROMPT_TAIL,
    Abort,
    ChatMessage,
    EngineRequest,
    MessageError,
    RequestError,
    TokenizeRequest,
    WorkerReady,
    decode,
    encode,
    pack_ids,
    unpack_ids,
)
from pipeserve.sampling_params import SamplingParams
from pipeserve.tokenizer.load import load_tokenizer, model_limits, resolve_model_dir
from pipeserve.tokenizer.worker import Tokenizer
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
            "{{ raise_exception('system must come first') }}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def stories(stories_dir: str):
    return load_tokenizer(stories_dir)


@pytest.fixture(scope="module")
def worker(stories) -> Tokenizer:
    return Tokenizer(stories, max_model_len=64)


@pytest.fixture(scope="module")
def chat_worker(stories_dir: str) -> Tokenizer:
    tok = load_tokenizer(stories_dir)
    tok.chat_template = TEMPLATE
    return Tokenizer(tok, max_model_len=512)


def request(rid: str = "r", sampling: dict | None = None, messages: list[dict] | None = None,
            **fields) -> TokenizeRequest:
    chat = None if messages is None else [ChatMessage(**m) for m in messages]
    return TokenizeRequest(rid, SamplingParams(**(sampling or {})), messages=chat, **fields)


def error(worker: Tokenizer, req: TokenizeRequest) -> str:
    out = worker.handle(req)
    assert isinstance(out, RequestError) and out.rid == req.rid and out.code == "INVALID_ARGUMENT", out
    return out.message


def test_load_helpers(stories_dir: str, stories) -> None:
    limits = model_limits(stories_dir)
    assert (limits.context_len, limits.vocab_size) == (512, 512)
    assert resolve_model_dir(stories_dir) == stories_dir
    assert type(stories).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert stories.decode(stories.encode("Once upon a time"), skip_special_tokens=True) == "Once upon a time"


def test_tokenizer_and_engine_read_the_config_one_way(stories_dir: str, tmp_path) -> None:
    """One reader (pipeserve.model_config): a multimodal wrapper's text_config, and a config that
    states no context length, give the tokenizer and the engine the same limits."""
    from pipeserve.model_config import DEFAULT_CONTEXT_LENGTH, ModelConfig

    with open(os.path.join(stories_dir, "config.json")) as f:
        cfg = json.load(f)
    for name, body in (
        ("wrapped", {"architectures": cfg["architectures"], "text_config": cfg | {"seq_length": 77}}),
        ("bare", {k: v for k, v in cfg.items() if k != "max_position_embeddings"}),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(body))
        limits, model = model_limits(str(tmp_path / name)), ModelConfig.from_dir(str(tmp_path / name))
        assert (limits.context_len, limits.vocab_size) == (model.max_position_embeddings, model.vocab_size)
    assert model_limits(str(tmp_path / "wrapped")).context_len == cfg["max_position_embeddings"]
    assert model_limits(str(tmp_path / "bare")).context_len == DEFAULT_CONTEXT_LENGTH


def test_prompt_becomes_ids(worker: Tokenizer, stories) -> None:
    out = worker.handle(request(prompt="Once upon a time 中😀", app="chat", arrival=3.5,
                                sampling={"max_tokens": 8, "stop": ["x"]}))
    assert isinstance(out, EngineRequest)
    ids = unpack_ids(out.prompt_ids).tolist()
    assert ids == stories.encode("Once upon a time 中😀") and ids[0] == stories.bos_token_id
    assert (out.rid, out.app, out.arrival) == ("r", "chat", 3.5)
    assert out.sampling == SamplingParams(max_tokens=8)  # stop strings are the detokenizer's only
    settings = worker.detokenize_request(request(prompt="x", sampling={"stop": ["x"], "logprobs": 2},
                                                 n=2, engine=1), out)
    assert (settings.rids, settings.prompt_len, settings.stop, settings.logprobs, settings.engine) == (
        ["r-0", "r-1"], len(ids), ["x"], True, 1)
    assert unpack_ids(settings.prompt_tail).tolist() == ids[-PROMPT_TAIL:] and settings.skip_special_tokens


def test_chat_messages_use_the_template(chat_worker: Tokenizer, worker: Tokenizer, stories) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 中"}]
    out = chat_worker.handle(request(messages=messages))
    assert isinstance(out, EngineRequest)
    text = stories.decode(unpack_ids(out.prompt_ids).tolist())
    assert text == "<s> system: Be brief.\nuser: Hi 中\nassistant:"  # one BOS: the template's
    assert "messages" in error(worker, request(messages=messages))  # no chat template
    assert "system must come first" in error(chat_worker, request(messages=messages[::-1]))


def test_prompt_ids_are_checked_against_the_vocab(worker: Tokenizer) -> None:
    out = worker.handle(request(prompt_ids=pack_ids([1, 403, 407])))
    assert isinstance(out, EngineRequest) and unpack_ids(out.prompt_ids).tolist() == [1, 403, 407]
    assert "prompt_token_ids" in error(worker, request(prompt_ids=pack_ids([1, 512])))
    assert "prompt_token_ids" in error(worker, request(prompt_ids=pack_ids([-3])))
    assert "prompt_token_ids" in error(worker, request(prompt_ids=b""))
    assert "prompt_token_ids" in error(worker, request(prompt_ids=b"\x01\x02\x03"))


def test_request_shape_and_sampling_are_the_gateways(worker: Tokenizer) -> None:
    """The gateway validated them: a request that breaks its rules is a bug upstream (INTERNAL), and
    sampling that is not a SamplingParams never decodes."""
    for req in (request(), request(prompt="a", prompt_ids=pack_ids([1]))):
        out = worker.handle(req)
        assert isinstance(out, RequestError) and out.code == "INTERNAL"
    wire = msgpack.unpackb(encode(request(prompt="a")))
    wire["sampling"]["bogus"] = 1
    with pytest.raises(MessageError, match="bogus"):
        TokenizeRequest.decode(msgpack.packb(wire))
    wire["sampling"] = {"max_tokens": "4"}
    with pytest.raises(MessageError, match="max_tokens"):
        TokenizeRequest.decode(msgpack.packb(wire))


def test_length_rules(worker: Tokenizer) -> None:
    """The context is 64 here: a prompt must leave room for one token, and max_tokens must fit in
    what it leaves (refused with the numbers, never silently cut short)."""
    ids = [1] + [403] * 62
    msg = error(worker, request(prompt_ids=pack_ids(ids), sampling={"max_tokens": 100, "min_tokens": 50}))
    assert "max_tokens is 100" in msg and "at most 1 can be generated" in msg, msg
    out = worker.handle(request(prompt_ids=pack_ids(ids), sampling={"max_tokens": 1, "min_tokens": 1}))
    assert isinstance(out, EngineRequest)
    assert (out.sampling.max_tokens, out.sampling.min_tokens) == (1, 1)
    msg = error(worker, request(prompt_ids=pack_ids(ids + [407])))
    assert "prompt_token_ids" in msg and "64" in msg
    assert "prompt is" in error(worker, request(prompt="Once upon a time " * 20))
    out = worker.handle(request(prompt="Hi", sampling={"max_tokens": 10}))
    assert out.sampling.max_tokens == 10  # fits: untouched


def test_tokenizer_failure_is_one_error_not_a_crash(stories) -> None:
    class Broken:
        chat_template = None

        def __len__(self) -> int:
            return 512

        def encode(self, text: str) -> list[int]:
            raise RuntimeError("boom")

    out = Tokenizer(Broken(), 64).handle(request(prompt="hi"))
    assert isinstance(out, RequestError) and out.code == "INTERNAL" and "boom" in out.message


# -- the processes ----------------------------------------------------------------------------

def wait_for_line(proc: subprocess.Popen, needle: str, timeout_s: float = 30) -> None:
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sel.select(0.2) and needle in proc.stderr.readline():
            return
        assert proc.poll() is None, "worker died"
    raise AssertionError(f"no {needle!r} from the worker")


def test_two_worker_processes(stories_dir: str, stories, tmp_path) -> None:
    """Two workers announce themselves to the gateway's ROUTER, tokenize what each is sent, tell the
    detokenizer each request's settings before its add, and forward an abort behind its add."""
    addr = {name: f"ipc://{tmp_path}/{name}" for name in ("tokenize", "requests", "errors", "steps")}
    ctx = zmq.Context()
    router, requests, errors = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    detok = ctx.socket(zmq.PULL)
    router.bind(addr["tokenize"])
    requests.bind(addr["requests"])
    errors.bind(addr["errors"])
    detok.bind(addr["steps"])
    cmd = [sys.executable, "-m", "pipeserve.cli", "tokenizer", "--model", stories_dir,
           "--max-model-len", "32", "--log-level", "debug", *[f"--{k}={v}" for k, v in addr.items()]]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        workers: set[bytes] = set()
        while len(workers) < 2:
            assert router.poll(30_000), "the workers did not announce themselves"
            worker, data = router.recv_multipart()
            assert isinstance(decode(data), WorkerReady)
            workers.add(worker)
        one, two = sorted(workers)

        def send(worker: bytes, msg: Any) -> None:
            router.send_multipart([worker, msg if isinstance(msg, bytes) else encode(msg)])

        send(one, b"not msgpack")  # malformed: dropped, the worker keeps serving
        send(two, EngineRequest("wrong-type", b"", SamplingParams()))
        n = 40
        for i in range(n):
            req = request(f"r{i}", prompt=f"Lily had {i} red balls.", sampling={"max_tokens": 12,
                                                                                 "stop": ["."]})
            send(one if i % 2 else two, req)
            if i == 7:
                send(one, Abort(["r7"]))  # through the worker that took its add: it comes after it
        send(one, request("long", prompt="Once upon a time " * 10))
        send(two, request("greedy", prompt="Lily had 7 red balls.", sampling={"max_tokens": 60}))
        send(one, request("bad", prompt_ids=pack_ids([9999])))
        got, order = {}, []
        while len(got) < n + 1:
            assert requests.poll(10_000), f"only {len(got)} of {n} requests came back"
            msg = decode(requests.recv())
            got[msg.rid if isinstance(msg, EngineRequest) else "abort"] = msg
            order.append(msg.rid if isinstance(msg, EngineRequest) else "abort")
        assert order.index("abort") > order.index("r7") and got["abort"].rids == ["r7"]
        ids = stories.encode("Lily had 7 red balls.")
        assert unpack_ids(got["r7"].prompt_ids).tolist() == ids
        assert got["r7"].sampling.max_tokens == 12 and got["r7"].sampling.stop == []
        settings = {}
        while len(settings) < n:
            assert detok.poll(10_000), f"settings of {len(settings)} requests came"
            msg = decode(detok.recv())
            settings[msg.rids[0]] = msg
        assert (settings["r7"].stop, settings["r7"].prompt_len) == (["."], len(ids))
        failed = {}
        while len(failed) < 3:
            assert errors.poll(10_000), f"errors so far: {failed}"
            msg = decode(errors.recv())
            failed[msg.rid] = msg
        assert failed["long"].code == failed["bad"].code == failed["greedy"].code == "INVALID_ARGUMENT"
        assert "max_tokens is 60" in failed["greedy"].message
        assert "prompt" in failed["long"].message and "prompt_token_ids" in failed["bad"].message
        assert all(p.poll() is None for p in procs)
    finally:
        for p in procs:
            p.terminate()
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(10))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        ctx.destroy(linger=0)
    logs = [p.stderr.read() for p in procs]
    assert codes == [0, 0]  # SIGTERM is a clean exit
    assert all(log.count("tokenized") > 0 for log in logs), logs  # both workers got work
    assert sum(log.count("dropping malformed") for log in logs) == 2


def test_n_engine_requests_from_one_tokenization(worker: Tokenizer) -> None:
    """n > 1: one EngineRequest per engine id with the same ids, seeds seed + i; errors likewise."""
    outs = worker.handle_all(request(rid="m", prompt="Once upon", n=3, sampling={"seed": 7}))
    assert [o.rid for o in outs] == ["m-0", "m-1", "m-2"]
    assert all(isinstance(o, EngineRequest) and o.prompt_ids == outs[0].prompt_ids for o in outs)
    assert [o.sampling.seed for o in outs] == [7, 8, 9]
    unseeded = worker.handle_all(request(rid="u", prompt="Once upon", n=2))
    assert [o.sampling.seed for o in unseeded] == [None, None]  # the engine draws each its own
    errors = worker.handle_all(request(rid="e", prompt_ids=pack_ids([1, 99999]), n=2))
    assert [(type(o).__name__, o.rid) for o in errors] == [("RequestError", "e-0"), ("RequestError", "e-1")]


def test_fit_max_tokens_lowers_max_tokens_to_the_room_left(worker: Tokenizer) -> None:
    out = worker.handle(request(prompt="Once upon a time", sampling={"max_tokens": 64}, fit_max_tokens=True))
    assert isinstance(out, EngineRequest)
    assert out.sampling.max_tokens == 64 - len(unpack_ids(out.prompt_ids))
    refused = worker.handle(request(prompt="Once upon a time", sampling={"max_tokens": 64}))
    assert isinstance(refused, RequestError) and "max_tokens" in refused.message
