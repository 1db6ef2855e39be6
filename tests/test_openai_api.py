"""The OpenAI-compatible HTTP API against a fake pipeline: the official `openai` client (sync and
async) and raw httpx talk to the gateway's HTTP port while the test plays tokenizer, engine and
detokenizer on the gateway's real sockets (tests/test_gateway.FakePipeline)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from pipeserve.local_cluster import scrape
from pipeserve.messages import (
    ChatMessage,
    ProcessStatus,
    RequestError,
    TokenLogprob,
    TopLogprob,
    encode,
    unpack_ids,
)
from pipeserve.sampling_params import MAX_STOP_STRINGS
from tests.test_gateway import FakePipeline

pytestmark = pytest.mark.timeout(60)


class HTTPPipeline(FakePipeline):
    def __init__(self, directory: str, **config: Any) -> None:
        super().__init__(directory, http_port=0, **config)
        self.url = f"http://127.0.0.1:{self.gateway.http.port}"
        key = config.get("api_key") or "unused"
        self.openai = openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=20)
        self.pool = ThreadPoolExecutor(4)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """A blocking client call in the background while the test plays the pipeline."""
        return self.pool.submit(fn, *args, **kwargs)

    def serve(self, rows: list[tuple[str, list[int], str]], rid: str | None = None) -> str:
        """Answer the next request with rows of (text, ids, finish); its rid."""
        rid = rid or self.next_request().rid
        for text, ids, finish in rows:
            self.send([(rid, text, ids, finish)])
        return rid

    def close(self) -> None:
        self.openai.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        super().close()


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """One pipeline for the tests that leave no state behind (each answers or aborts its requests)."""
    pipeline = HTTPPipeline(str(tmp_path_factory.mktemp("http")))
    yield pipeline
    pipeline.close()


@pytest.fixture
def fresh(tmp_path):
    """A pipeline of its own, for tests that read absolute counters or stop its heartbeats."""
    pipeline = HTTPPipeline(str(tmp_path))
    yield pipeline
    pipeline.close()


def test_completion_fields_text_and_usage(api):
    future = api.call(
        api.openai.completions.create,
        model="fake",
        prompt="Hello",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        stop=["."],
        presence_penalty=0.5,
        frequency_penalty=0.25,
        user="u1",
        extra_body={"top_k": 4, "min_p": 0.1, "repetition_penalty": 1.2, "priority": -2},
    )
    req = api.next_request()
    s = req.sampling
    assert s.priority == -2
    assert req.prompt == "Hello" and req.n == 1 and not req.fit_max_tokens
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop, s.top_k, s.min_p) == (
        7,
        0.5,
        0.9,
        3,
        ["."],
        4,
        0.1,
    )
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.logprobs) == (
        0.5,
        0.25,
        1.2,
        None,
    )
    api.serve([("Hi", [7], ""), (" there", [8, 9], "stop")], req.rid)
    out = future.result(10)
    assert out.object == "text_completion" and out.model == "fake" and out.id.startswith("cmpl-")
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [(0, "Hi there", "stop")]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 3, 6)
    assert out.usage.prompt_tokens_details.cached_tokens == 2


def test_prompt_forms_and_n(api):
    """A list of prompts and n=2: every prompt tokenized once as n engine requests (seed + i)."""
    future = api.call(
        api.openai.completions.create, model="fake", prompt=[[5, 6], [7]], n=2, seed=10, max_tokens=2
    )
    first, second = api.next_request(), api.next_request()
    assert [unpack_ids(r.prompt_ids).tolist() for r in (first, second)] == [[5, 6], [7]]
    assert first.n == second.n == 2 and first.engine_rids() == [f"{first.rid}-0", f"{first.rid}-1"]
    for req in (first, second):
        for i, rid in enumerate(req.engine_rids()):
            api.serve([(f"{rid[-3:]}", [i], "length")], rid)
    out = future.result(10)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == ["0-0", "0-1", "1-0", "1-1"]
    assert out.usage.prompt_tokens == 6  # 3 per prompt (the fake's count), once for its n choices
    assert out.usage.completion_tokens == 4


def test_stream_include_usage_and_sse_framing(api):
    api.call(api.serve, [("a", [1], ""), ("b", [2], ""), ("", [], "length")])  # the response waits for it
    with httpx.Client(base_url=api.url, timeout=10) as http:
        with http.stream(
            "POST",
            "/v1/completions",
            json={
                "model": "fake",
                "prompt": "x",
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            body = response.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "ab"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def test_chat_stream_with_the_sdk_and_logprobs(api):
    def run() -> list[Any]:
        stream = api.openai.chat.completions.create(
            model="fake",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            stream=True,
            logprobs=True,
            top_logprobs=2,
            max_completion_tokens=5,
        )
        return list(stream)

    future = api.call(run)
    req = api.next_request()
    assert req.messages == [ChatMessage("system", "be brief"), ChatMessage("user", "hi")]
    assert req.sampling.max_tokens == 5 and req.sampling.logprobs == 2
    top = TokenLogprob(7, "Hi", -0.1, [TopLogprob(7, "Hi", -0.1), TopLogprob(8, "Ho", -2.5)])
    api.send([(req.rid, "Hi", [7], "")], logprobs=[[top]])
    api.send([(req.rid, "!", [9], "stop")], logprobs=[[TokenLogprob(9, "!", -0.5, [])]])
    chunks = future.result(10)
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hi!"
    assert chunks[-1].choices[0].finish_reason == "stop"
    lp = chunks[0].choices[0].logprobs.content[0]
    assert (lp.token, lp.logprob, lp.bytes) == ("Hi", -0.1, list(b"Hi"))
    assert [(t.token, t.logprob) for t in lp.top_logprobs] == [("Hi", -0.1), ("Ho", -2.5)]


def test_chat_without_max_tokens_fits_the_context(api):
    future = api.call(
        api.openai.chat.completions.create, model="fake", messages=[{"role": "user", "content": "q"}]
    )
    req = api.next_request()
    assert req.fit_max_tokens and req.sampling.max_tokens == 512  # the tokenizer lowers it to the room left
    api.serve([("answer", [4], "stop")], req.rid)
    out = future.result(10)
    assert out.choices[0].message.content == "answer" and out.choices[0].message.role == "assistant"
    assert out.object == "chat.completion"


def test_completion_logprobs(api):
    future = api.call(api.openai.completions.create, model="fake", prompt="x", logprobs=1, max_tokens=2)
    req = api.next_request()
    assert req.sampling.logprobs == 1
    entries = [
        TokenLogprob(7, "Hi", -0.1, [TopLogprob(7, "Hi", -0.1)]),
        TokenLogprob(8, " yo", -1.5, [TopLogprob(9, " ya", -0.9)]),
    ]
    api.send([(req.rid, "Hi yo", [7, 8], "length")], logprobs=[entries])
    lp = future.result(10).choices[0].logprobs
    assert lp.tokens == ["Hi", " yo"] and lp.token_logprobs == [-0.1, -1.5]
    assert lp.top_logprobs == [{"Hi": -0.1}, {" ya": -0.9}] and lp.text_offset == [0, 2]


def test_async_client(api):
    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=api.url + "/v1", api_key="x", max_retries=0)
        try:
            one = await client.completions.create(model="fake", prompt="p", max_tokens=1)
            stream = await client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "c"}], stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            return one.choices[0].text, text
        finally:
            await client.close()

    future = api.call(asyncio.run, run())
    api.serve([("one", [1], "length")])
    api.serve([("tw", [2], ""), ("o", [3], "stop")])
    assert future.result(10) == ("one", "two")


def test_api_key(tmp_path):
    api = HTTPPipeline(str(tmp_path), api_key="sekret")
    try:
        wrong = openai.OpenAI(base_url=api.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.models.list()
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        for path in ("/v1/completions", "/v1/chat/completions"):  # the generation routes check it too
            response = httpx.post(api.url + path, json={"prompt": "x", "messages": []}, timeout=10)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert api.tokenize.poll(50) == 0
        assert [m.id for m in api.openai.models.list()] == ["fake"]
        assert httpx.get(api.url + "/health").status_code == 200  # probes carry no secrets
    finally:
        api.close()


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 2**31]}, "prompt"),
        ({"prompt": [1, -1]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "temperature": -1.0}, "temperature"),
        ({"prompt": "x", "top_p": 0.0}, "top_p"),
        ({"prompt": "x", "top_k": 0}, "top_k"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),  # a type error is a 400 too, not a 422
        ({"prompt": "x", "logprobs": 6}, "logprobs"),  # the engine allows 5 (INFO)
        ({"prompt": "x", "seed": 2**63}, "seed"),
        ({"prompt": "x", "stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"prompt": "x" * (5 * 1024 * 1024)}, "prompt"),  # over max_request_bytes (4 MiB)
        ({"prompt": "x", "cache_salt": "s" * 300}, "cache_salt"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids"),
        ({"prompt": "x", "stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"prompt": "x", "max_tokens": 2**40}, "max_tokens"),
        ({"prompt": "x", "priority": 2**40}, "priority"),
        ({"prompt": "x", "priority": "high"}, "priority"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_input_is_400_naming_the_parameter(api, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(api.url + path, json={"model": "fake", **body}, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"
    assert api.tokenize.poll(50) == 0  # nothing reached the pipeline


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b""])
def test_a_body_that_is_no_json_object_is_400(api, path, content):
    response = httpx.post(api.url + path, content=content, headers={"Content-Type": "application/json"},
                          timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("request body: ")
    assert api.tokenize.poll(50) == 0


def test_errors_as_the_sdk_exception_classes(tmp_path):
    api = HTTPPipeline(str(tmp_path), max_inflight=1)
    try:
        with pytest.raises(openai.BadRequestError) as bad:
            api.openai.completions.create(model="fake", prompt="x", temperature=-1)
        assert bad.value.status_code == 400 and bad.value.param == "temperature"
        with pytest.raises(openai.NotFoundError) as missing:
            api.openai.completions.create(model="gpt-4", prompt="x")
        assert missing.value.code == "model_not_found"
        held = api.call(api.openai.completions.create, model="fake", prompt="x")
        rid = api.next_request().rid
        response = httpx.post(api.url + "/v1/completions", json={"prompt": "y"}, timeout=10)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        with pytest.raises(openai.InternalServerError) as full:
            api.openai.completions.create(model="fake", prompt="y")
        assert full.value.status_code == 503
        api.send([(rid, "", [], "stop")])
        held.result(10)
        failing = api.call(api.openai.completions.create, model="fake", prompt="z")
        api.errors.send(
            encode(RequestError(api.next_request().rid, "INVALID_ARGUMENT", "prompt is 600 tokens long"))
        )
        with pytest.raises(openai.BadRequestError) as long:
            failing.result(10)
        assert long.value.param == "prompt"
    finally:
        api.close()


def test_error_after_the_stream_began_is_an_sse_error_event(fresh):
    api = fresh  # the engine is reported down
    served = api.call(api.serve, [("a", [1], "")])
    with httpx.Client(base_url=api.url, timeout=10) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as response:
            rid = served.result(10)
            lines = (line for line in response.iter_lines() if line)
            first = json.loads(next(lines).removeprefix("data: "))
            api.status.send(encode(ProcessStatus("engine", False)))  # only once "a" was streamed
            events = list(lines)
    assert first["choices"][0]["text"] == "a"
    error = json.loads(events[0].removeprefix("data: "))["error"]
    assert "engine" in error["message"] and error["code"] == "unavailable"
    assert events[1:] == ["data: [DONE]"]
    assert api.next_abort().rids == [rid]


@pytest.mark.parametrize("chat", [False, True])
def test_a_refusal_before_the_first_token_is_an_http_error_even_when_streamed(api, chat):
    """The pipeline refuses a streamed request (no chat template, max_tokens beyond the context)
    before its first token: a 400 with OpenAI's error body and no stream bytes, so the SDK raises
    BadRequestError as it does without streaming."""
    message = "messages: this model has no chat template; send a prompt instead" if chat else (
        "max_tokens is 900, but the context is 512 tokens and prompt takes 3: at most 509 can be "
        "generated; lower max_tokens")

    def refuse() -> None:
        api.errors.send(encode(RequestError(api.next_request().rid, "INVALID_ARGUMENT", message)))

    api.call(refuse)
    with pytest.raises(openai.BadRequestError) as refused:
        if chat:
            list(api.openai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "q"}],
                                                    stream=True))
        else:
            list(api.openai.completions.create(model="fake", prompt="x", max_tokens=900, stream=True))
    assert refused.value.status_code == 400 and refused.value.param == ("messages" if chat else "max_tokens")
    api.call(refuse)
    response = httpx.post(api.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=10)
    assert response.status_code == 400 and response.headers["content-type"] == "application/json"
    assert response.json()["error"]["message"] == message
    api.wait(lambda: api.metric("pipeserve_gateway_inflight") == 0)


def test_a_streamed_n_request_refused_in_one_choice_before_any_token_is_an_http_error(api):
    def refuse() -> None:
        req = api.next_request()
        api.errors.send(encode(RequestError(req.engine_rids()[1], "INVALID_ARGUMENT", "prompt is too long")))

    api.call(refuse)
    response = httpx.post(api.url + "/v1/completions", json={"prompt": "x", "stream": True, "n": 2},
                          timeout=10)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert api.next_abort(via="worker").rids[0].endswith("-0")  # the other choice: aborted behind its add
    api.wait(lambda: api.metric("pipeserve_gateway_inflight") == 0)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_in_the_engine(api, stream):
    with httpx.Client(base_url=api.url, timeout=10) as http:
        if stream:
            served = api.call(api.serve, [("a", [1], "")])
            with http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as response:
                rid = served.result(10)
                next(response.iter_bytes())
        else:

            def leave() -> None:
                with pytest.raises(httpx.ReadTimeout):
                    http.post("/v1/completions", json={"prompt": "x"}, timeout=0.5)

            thread = threading.Thread(target=leave)
            thread.start()
            rid = api.next_request().rid
            thread.join()
    assert api.next_abort(via="control" if stream else "worker").rids == [rid]
    api.wait(lambda: api.metric("pipeserve_gateway_inflight") == 0)


def test_health_models_version_and_metrics(fresh):
    api = fresh
    assert httpx.get(api.url + "/health").status_code == 200
    models = httpx.get(api.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake"
    assert models["data"][0]["max_model_len"] == 512
    assert httpx.get(api.url + "/version").json()["version"]
    text = httpx.get(api.url + "/metrics").text
    assert 'pipeserve:num_requests_running{engine="0"} 0.0' in text and "pipeserve_gateway_inflight" in text
    api.beating.clear()  # heartbeats stop: not serving
    api.wait(lambda: httpx.get(api.url + "/health").status_code == 503)
    refused = httpx.post(api.url + "/v1/completions", json={"prompt": "x"})
    assert refused.status_code == 503 and "not serving" in refused.json()["error"]["message"]


def test_metrics_follow_a_known_workload(fresh):
    """Three requests: counters equal what was sent, histograms hold one sample per request (TTFT,
    e2e, queue time, token counts) and one per token after the first (inter-token latency)."""
    api = fresh
    api.stats.update(
        pages_total=100,
        pages_used=25,
        waiting=2,
        preemptions=4,
        prefix_cache_queries=64,
        prefix_cache_hits=16,
    )
    futures = [
        api.call(api.openai.completions.create, model="fake", prompt="x", max_tokens=5) for _ in range(3)
    ]
    reqs = sorted((api.next_request() for _ in futures), key=lambda r: r.rid)
    api.serve([("a", [1], ""), ("bc", [2, 3], ""), ("d", [4], "length")], reqs[0].rid)  # 4 tokens
    api.serve([("a", [1], "stop")], reqs[1].rid)  # 1 token
    api.serve([("ab", [1, 2], "stop")], reqs[2].rid)  # 2 tokens, in one delta
    for f in futures:
        f.result(10)
    m = scrape(api.metrics_port)
    assert m["pipeserve:generation_tokens_total"] == 7
    assert m["pipeserve:prompt_tokens_total"] == 9  # 3 per request (the fake's count)
    assert m['pipeserve:request_success_total{finished_reason="stop"}'] == 2
    assert m['pipeserve:request_success_total{finished_reason="length"}'] == 1
    assert m['pipeserve:request_success_total{finished_reason="abort"}'] == 0
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert m[f"pipeserve:{name}_count"] == 3, name
    assert m["pipeserve:inter_token_latency_seconds_count"] == 7 - 3
    assert m["pipeserve:request_generation_tokens_sum"] == 7
    assert m['pipeserve:request_generation_tokens_bucket{le="1.0"}'] == 1
    assert m['pipeserve:request_generation_tokens_bucket{le="5.0"}'] == 3
    assert m['pipeserve:time_to_first_token_seconds_bucket{le="+Inf"}'] == 3
    # Engine-level series carry the engine's index (vLLM's label under data parallelism).
    usage = 'pipeserve:kv_cache_usage_perc{engine="0"}'
    api.wait(lambda: usage in scrape(api.metrics_port))  # the next heartbeat
    m = {name.replace('{engine="0"}', ""): value for name, value in scrape(api.metrics_port).items()}
    assert m["pipeserve:kv_cache_usage_perc"] == 0.25 and m["pipeserve:num_requests_waiting"] == 2
    assert m["pipeserve:num_preemptions_total"] == 4
    assert (m["pipeserve:prefix_cache_queries_total"], m["pipeserve:prefix_cache_hits_total"]) == (64, 16)
    # The same registry at HTTP /metrics.
    http = httpx.get(api.url + "/metrics").text
    assert "pipeserve:generation_tokens_total 7.0" in http


def test_grpc_traffic_counts_in_the_same_metrics(fresh):
    api = fresh
    call = api.client.stream("x", request_id="g1")
    api.next_request()
    api.send([("g1", "a", [1], "stop")])
    list(call)
    time.sleep(0.05)
    m = scrape(api.metrics_port)
    assert (
        m["pipeserve:generation_tokens_total"] == 1 and m["pipeserve:time_to_first_token_seconds_count"] == 1
    )


def test_return_token_ids_keeps_tokens_whose_text_is_held_back(api):
    """A token that adds no text yet (half a UTF-8 character) still reaches the client's ids."""
    body = {"prompt": "x", "stream": True, "return_token_ids": True}
    api.call(api.serve, [("a", [1], ""), ("", [2], ""), ("é", [3], "length")])
    with httpx.Client(base_url=api.url, timeout=10) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            raw = response.read().decode().split("\n\n")[:-2]
    events = [json.loads(e.removeprefix("data: ")) for e in raw]
    assert [i for e in events for i in e["choices"][0]["token_ids"]] == [1, 2, 3]
    assert "".join(e["choices"][0]["text"] for e in events) == "aé"


def test_data_parallel_http_requests_are_routed_and_metrics_carry_the_engine(tmp_path):
    """Two engines behind the HTTP API: requests go through the router (n copies to one engine),
    a disconnect aborts on the engine running it, and vLLM-named engine series have engine="i"."""
    api = HTTPPipeline(str(tmp_path), engines=2, dp_balance_threshold=8)
    try:
        api.per_engine = {0: {"running": 3, "waiting": 5, "pages_used": 50, "pages_total": 100},
                          1: {"running": 1, "waiting": 0, "pages_used": 10, "pages_total": 40}}
        api.wait(lambda: [v.load() for v in api.gateway.core.router.engines] == [23, 1])
        done = api.call(api.openai.completions.create, model="fake", prompt="x", max_tokens=2, n=2)
        req = api.next_request()
        assert (req.engine, req.n) == (1, 2)
        for rid in req.engine_rids():
            api.send([(rid, "a", [1], "stop")])
        assert [c.text for c in done.result(10).choices] == ["a", "a"]
        served = api.call(api.serve, [("b", [2], "")])
        with httpx.Client(base_url=api.url, timeout=10) as http:
            with http.stream("POST", "/v1/completions", json={"prompt": "y", "stream": True}) as response:
                rid = served.result(10)
                next(response.iter_bytes())
        assert api.next_abort(engine=1).rids == [rid] and not api.controls[0].poll(200)
        api.wait(lambda: api.metric("pipeserve_gateway_inflight") == 0)
        m = scrape(api.metrics_port)
        assert m['pipeserve_gateway_routed_requests_total{engine="1"}'] == 2
        assert m['pipeserve_gateway_routed_requests_total{engine="0"}'] == 0
        assert m['pipeserve:num_requests_running{engine="0"}'] == 3
        assert m['pipeserve:num_requests_waiting{engine="0"}'] == 5
        assert m['pipeserve:kv_cache_usage_perc{engine="1"}'] == 0.25
        assert m["pipeserve:generation_tokens_total"] == 3
        assert 'pipeserve:num_requests_running{engine="1"} 1.0' in httpx.get(api.url + "/metrics").text
    finally:
        api.close()


def test_the_http_front_end_imports_nothing_of_grpc():
    """openai_api runs over the transport-free core: importing it (and serving a request's types)
    loads no grpc, protobuf or gRPC front-end module."""
    code = (
        "import sys, pipeserve.gateway.openai_api\n"
        "grpc = ('grpc', 'grpc_health', 'grpc_reflection', 'google.protobuf', 'pipeserve.gateway.pb',\n"
        "        'pipeserve.gateway.grpc_api', 'pipeserve.gateway.server', 'pipeserve.gateway.client')\n"
        "print(sorted(m for m in sys.modules if any(m == g or m.startswith(g + '.') for g in grpc)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("json_out", [False, True])
def test_generate_cli_on_the_http_port_says_to_use_the_grpc_one(api, capsys, json_out):
    from pipeserve import cli
    from pipeserve.gateway import client

    target = f"127.0.0.1:{api.gateway.http.port}"
    parser = cli.build_parser(cli.COMMANDS, "pipeserve", "generate")
    args = parser.parse_args(["hello", "--target", target, "--timeout", "10",
                              *(["--json"] if json_out else [])])
    assert client.main(args) == 1
    out, err = capsys.readouterr()
    text = json.loads(out)["error"]["message"] if json_out else err
    assert f"{target} is an HTTP port" in text and "gRPC port (--port, 50051" in text
    assert len(text.strip().splitlines()) == 1
    assert client.http_hint(api.target) is None  # the gRPC port is no HTTP/1 port


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_that_is_not_json_by_its_content_type_is_415(api, path, kind):
    """Bodies a browser may send from any page without a CORS preflight are refused unread."""
    headers = {"Content-Type": kind} if kind else {}
    body = b'{"model": "fake", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}'
    response = httpx.post(api.url + path, content=body, headers=headers, timeout=10)
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert api.tokenize.poll(50) == 0
    ok = httpx.post(api.url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 0}',
                    headers={"Content-Type": "application/json; charset=utf-8"}, timeout=10)
    assert ok.status_code == 400 and ok.json()["error"]["param"] == "max_tokens"  # parsed: JSON it is


def test_unknown_paths_and_methods_answer_in_openai_error_shape(api):
    missing = httpx.get(api.url + "/v1/nothing", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = httpx.get(api.url + "/v1/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert wrong.headers["allow"] == "POST" and "GET /v1/completions" in wrong.json()["error"]["message"]


def test_top_logprobs_is_checked_as_top_logprobs(api):
    for body in ({"top_logprobs": 3}, {"top_logprobs": 3, "logprobs": False},
                 {"top_logprobs": 6, "logprobs": True}):  # the engine allows 5 (INFO)
        response = httpx.post(api.url + "/v1/chat/completions", timeout=10,
                              json={"messages": [{"role": "user", "content": "x"}], **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "top_logprobs" and "top_logprobs" in error["message"]
    assert api.tokenize.poll(50) == 0


def test_cancels_and_disconnects_count_as_aborted_requests_quietly(fresh, caplog):
    """A client that leaves (HTTP disconnect, gRPC cancel, the Abort RPC) ends its request under
    finished_reason="abort"; it is normal: no error and no traceback in the log."""
    api = fresh
    caplog.set_level("DEBUG")
    metric = 'pipeserve:request_success_total{finished_reason="abort"}'
    assert api.metric(metric) == 0
    with httpx.Client(base_url=api.url, timeout=10) as http:
        def leave() -> None:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json={"prompt": "x"}, timeout=0.5)

        thread = threading.Thread(target=leave)
        thread.start()
        api.next_request()
        thread.join()
    call = api.client.stream("x", request_id="cancelled")
    assert api.serve([("a", [1], "")]) == "cancelled"
    next(call)
    call.cancel()
    held = api.client.stream("x", request_id="held")
    api.next_request()
    assert api.client.abort("held")
    assert list(held)[-1].finish_reason == "abort"
    api.wait(lambda: api.metric(metric) == 3)
    api.wait(lambda: api.metric("pipeserve_gateway_inflight") == 0)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


def test_cors_only_for_the_allowed_origins(tmp_path, api):
    """--allowed-origins: a browser's preflight from a listed origin is answered, others are not; by
    default no origin is (the preflight is a 405 like any OPTIONS)."""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    default = httpx.options(api.url + "/v1/completions", headers={"Origin": "https://app.test", **preflight})
    assert default.status_code == 405 and "access-control-allow-origin" not in default.headers
    cors = HTTPPipeline(str(tmp_path), allowed_origins="https://app.test, https://other.test")
    try:
        ok = httpx.options(cors.url + "/v1/completions", headers={"Origin": "https://app.test", **preflight})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.test"
        evil = {"Origin": "https://evil.test", **preflight}
        bad = httpx.options(cors.url + "/v1/completions", headers=evil)
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        models = httpx.get(cors.url + "/v1/models", headers={"Origin": "https://other.test"})
        assert models.headers["access-control-allow-origin"] == "https://other.test"
    finally:
        cors.close()


def _raw(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_slow_headers_slow_bodies_and_too_many_connections_are_cut_and_counted(tmp_path):
    api = HTTPPipeline(str(tmp_path), http_header_timeout=0.3, http_body_timeout=0.3, http_max_connections=3)
    port = api.gateway.http.port
    refused = 'pipeserve_gateway_http_refused_total{reason="%s"}'
    try:
        slow = _raw(port)
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert _read_all(slow) == b""  # closed without an answer
        body = _raw(port)
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        assert _read_all(body) == b""
        assert (api.metric(refused % "header_timeout"), api.metric(refused % "body_timeout")) == (1, 1)
        held = [_raw(port) for _ in range(2)]  # with the client below: 3 open, the limit
        for sock in held:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # answered, kept alive
        with httpx.Client(base_url=api.url, timeout=10) as http:
            assert http.get("/health").status_code == 200  # the third connection
            full = _read_all(_raw(port))  # the fourth
            assert full.startswith(b"HTTP/1.1 503") and b'"code": "max_connections"' in full
            assert api.metric(refused % "max_connections") == 1
        for sock in held:
            sock.close()
        assert httpx.get(api.url + "/health", timeout=10).status_code == 200  # room again
    finally:
        api.close()
