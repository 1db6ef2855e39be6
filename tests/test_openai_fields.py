"""Request fields over HTTP against a fake pipeline (tests/test_openai_api.HTTPPipeline): what the
server does not implement but would change the result is a 400 naming it, harmless bookkeeping
fields are accepted, and vLLM's `structured_outputs` reaches the engine as SamplingParams'
constraint."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.test_openai_api import HTTPPipeline

pytestmark = pytest.mark.timeout(60)

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "fake", "prompt": "hi"}
FUNCTION = {"name": "f", "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    pipeline = HTTPPipeline(str(tmp_path_factory.mktemp("fields")))
    yield pipeline
    pipeline.close()


def _post(api: HTTPPipeline, body: dict[str, Any]) -> httpx.Response:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return httpx.post(api.url + path, json=body, timeout=10)


@pytest.mark.parametrize(
    "body, param",
    [
        (CHAT | {"functions": [FUNCTION]}, "functions"),
        (CHAT | {"function_call": "auto"}, "function_call"),
        (CHAT | {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        (CHAT | {"modalities": ["text", "audio"]}, "modalities"),
        (CHAT | {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        (CHAT | {"store": True}, "store"),
        (CHAT | {"reasoning_effort": "low"}, "reasoning_effort"),
        (CHAT | {"guided_json": {"type": "object"}}, "guided_json"),
        (CHAT | {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
        (COMPLETION | {"suffix": "end"}, "suffix"),
        (COMPLETION | {"best_of": 3}, "best_of"),
        (COMPLETION | {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ],
)
def test_a_meaningful_field_the_server_lacks_is_400_naming_it(api, body, param):
    response = _post(api, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"
    assert error["code"] == "unsupported_parameter"
    assert api.tokenize.poll(50) == 0  # nothing reached the pipeline


def test_a_message_with_a_function_call_is_refused(api):
    body = CHAT | {"messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": None, "function_call": {"name": "f"}}]}
    response = _post(api, body)
    assert response.status_code == 400 and "function_call" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "messages"


def test_the_sdk_raises_bad_request_for_a_refused_field(api):
    with pytest.raises(openai.BadRequestError, match="prediction"):
        api.openai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                           prediction={"type": "content", "content": "x"})


@pytest.mark.parametrize(
    "extra",
    [
        {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"},
        {"modalities": ["text"], "tools": [], "tool_choice": "none", "logit_bias": {}, "best_of": 1},
        {"some_client_extension": 1},  # unknown: ignored, as vLLM
    ],
)
def test_harmless_fields_are_accepted(api, extra):
    future = api.call(api.openai.chat.completions.create, model="fake",
                      messages=[{"role": "user", "content": "hi", "name": "ann"}], extra_body=extra)
    req = api.next_request()
    api.serve([("ok", [4], "stop")], req.rid)
    assert future.result(10).choices[0].message.content == "ok"


@pytest.mark.parametrize(
    "given, field, value",
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}, "json_schema",
         {"type": "object", "properties": {"a": {"type": "integer"}}}),
        ({"json": '{"type": "string"}'}, "json_schema", '{"type": "string"}'),
        ({"regex": "[ab]+"}, "regex", "[ab]+"),
        ({"choice": ["yes", "no"]}, "choice", ["yes", "no"]),
        ({"grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
        ({"json_object": True}, "json_object", True),
    ],
)
@pytest.mark.parametrize("chat", [False, True])
def test_structured_outputs_reach_the_engine_as_the_constraint(api, given, field, value, chat):
    create = api.openai.chat.completions.create if chat else api.openai.completions.create
    kwargs: dict[str, Any] = {"messages": [{"role": "user", "content": "q"}]} if chat else {"prompt": "q"}
    future = api.call(create, model="fake", extra_body={"structured_outputs": given}, **kwargs)
    req = api.next_request()
    assert getattr(req.sampling, field) == value
    assert req.sampling.constrained
    api.serve([("no", [4], "stop")], req.rid)
    future.result(10)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": "yes"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "regex"),
    ],
)
def test_bad_structured_outputs_are_400(api, extra, param):
    response = _post(api, COMPLETION | extra)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert api.tokenize.poll(50) == 0
