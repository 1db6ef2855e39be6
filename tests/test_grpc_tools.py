"""Tools and reasoning over gRPC against a fake pipeline that plays the model's text: the same plan,
constraint and parsers as the HTTP chat completions (pipeserve/gateway/tool_calls.py), so a gRPC
Generate with messages and tools reaches the tokenizer as a chat request does, and its last response
carries the calls, content and reasoning that the HTTP API's message carries for the same text."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from pipeserve.gateway.client import Completion
from pipeserve.messages import ChatMessage
from pipeserve.tool_schema import parameters_schema, required_schema
from tests.test_openai_api import HTTPPipeline
from tests.test_openai_tools import TIME, USER, WEATHER

pytestmark = pytest.mark.timeout(60)

HERMES = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    pipeline = HTTPPipeline(str(tmp_path_factory.mktemp("grpc-tools")), enable_auto_tool_choice=True,
                            tool_call_parser="hermes")
    yield pipeline
    pipeline.close()


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    pipeline = HTTPPipeline(str(tmp_path_factory.mktemp("grpc-reasoning")), reasoning_parser="deepseek_r1",
                            enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield pipeline
    pipeline.close()


def generate(api: HTTPPipeline, text: list[str], messages: list[dict[str, Any]] = USER,
             finish: str = "stop", **kwargs: Any) -> tuple[Any, Completion]:
    """A gRPC Generate answered with text in these pieces; (the TokenizeRequest, the Completion)."""
    future = api.call(api.client.generate, messages, timeout=10, **kwargs)
    req = api.next_request()
    api.serve([(t, [i + 1], finish if i == len(text) - 1 else "") for i, t in enumerate(text)], req.rid)
    return req, future.result(10)


def http_chat(api: HTTPPipeline, text: list[str], **kwargs: Any) -> Any:
    future = api.call(api.openai.chat.completions.create, model="fake", messages=USER, **kwargs)
    req = api.next_request()
    api.serve([(t, [i + 1], "stop" if i == len(text) - 1 else "") for i, t in enumerate(text)], req.rid)
    return future.result(10)


def test_tools_and_the_history_reach_the_chat_template(api):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}
    history = USER + [{"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    req, out = generate(api, ["It is sunny."], history, tools=[WEATHER, TIME], tool_choice="none")
    assert [t["function"]["name"] for t in req.tools] == ["weather", "time"]
    assert req.tools[0]["function"]["parameters"] == WEATHER["function"]["parameters"]
    assert req.messages[1] == ChatMessage("assistant", "", [call], None)
    assert req.messages[2] == ChatMessage("tool", "sunny", None, "call_1")
    assert req.sampling.constraint() is None
    assert out.content == "It is sunny." and out.tool_calls == [] and out.finish_reason == "stop"


def test_auto_reads_calls_as_the_http_api_does(api):
    text = ["Let me see. ", HERMES[:20], HERMES[20:]]
    req, out = generate(api, text, tools=[WEATHER])  # unset tool_choice: auto (the server enables it)
    assert req.sampling.constraint() is None
    assert out.text == "".join(text)  # the deltas stream the raw text
    http = http_chat(api, text, tools=[WEATHER]).choices[0]
    assert out.content == http.message.content == "Let me see. "
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in http.message.tool_calls]
    assert out.tool_calls[0].id.startswith("call_")
    assert out.finish_reason == http.finish_reason == "tool_calls"


def test_parallel_tool_calls_false_keeps_one_call(api):
    _, out = generate(api, [HERMES + HERMES], tools=[WEATHER], parallel_tool_calls=False)
    assert len(out.tool_calls) == 1 and out.finish_reason == "tool_calls"


def test_required_and_named_are_constrained(api):
    req, out = generate(api, ['[{"name":"weather","parameters":{"city":"Rome"}}]'], tools=[WEATHER, TIME],
                        tool_choice="required")
    functions = [WEATHER["function"], TIME["function"]]
    assert json.loads(req.sampling.json_schema) == required_schema(functions, True)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("weather", '{"city":"Rome"}')]
    assert out.finish_reason == "tool_calls" and out.content is None
    req, out = generate(api, ['{"city":"Oslo"}'], tools=[WEATHER, TIME],
                        tool_choice={"type": "function", "function": {"name": "weather"}})
    assert json.loads(req.sampling.json_schema) == parameters_schema(WEATHER["function"])
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("weather", '{"city":"Oslo"}')]
    assert out.finish_reason == "stop"  # a named function: the engine's finish, as OpenAI


def test_plain_requests_are_unchanged(api):
    _, out = generate(api, ["Hello"], tools=None)
    assert out.text == "Hello" and out.content is None and out.reasoning is None and out.tool_calls == []


@pytest.mark.parametrize(
    "kwargs, prompt, message",
    [
        ({"tools": [WEATHER]}, "a prompt", "messages input"),
        ({"tool_choice": "auto"}, USER, "tool_choice needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, USER,
         "not among the tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, USER, "tool_choice must be"),
        ({"tools": [WEATHER], "tool_choice": "required", "json_object": True}, USER, "cannot be combined"),
    ],
)
def test_refusals(api, kwargs, prompt, message):
    with pytest.raises(grpc.RpcError) as info:
        api.client.generate(prompt, timeout=10, **kwargs)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()
    assert api.tokenize.poll(50) == 0


def test_invalid_parameters_json_is_refused(api):
    from pipeserve.gateway.client import build_request

    request = build_request(USER, tools=[WEATHER])
    request.tools[0].parameters = "{not json"
    with pytest.raises(grpc.RpcError) as info:
        list(api.client.stub.Generate(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tools[0].parameters" in info.value.details()


def test_auto_needs_the_server_flags(tmp_path):
    plain = HTTPPipeline(str(tmp_path))
    try:
        with pytest.raises(grpc.RpcError) as info:
            plain.client.generate(USER, timeout=10, tools=[WEATHER], tool_choice="auto")
        details = info.value.details()
        assert "--enable-auto-tool-choice" in details and "--tool-call-parser" in details
    finally:
        plain.close()


def test_reasoning_is_split_in_the_last_response(thinking):
    text = ["<think>Paris is", " sunny.</th", "ink>\n\nIt is sunny."]
    _, out = generate(thinking, text)
    assert out.text == "".join(text)
    assert out.reasoning == "Paris is sunny." and out.content == "\n\nIt is sunny."
    _, cut = generate(thinking, ["still thinking"], finish="length")
    assert cut.reasoning == "still thinking" and cut.content is None and cut.finish_reason == "length"
    # A prompt (not messages) is not a chat: its text is not split, as HTTP completions.
    future = thinking.call(thinking.client.generate, "a prompt", timeout=10)
    req = thinking.next_request()
    thinking.serve([("<think>a</think>b", [1], "stop")], req.rid)
    plain = future.result(10)
    assert plain.reasoning is None and plain.content is None


def test_reasoning_then_calls_and_constraints_after_it(thinking):
    text = ["<think>Use the tool.</think>", HERMES]
    _, out = generate(thinking, text, tools=[WEATHER])
    assert out.reasoning == "Use the tool." and out.content is None
    assert [c.name for c in out.tool_calls] == ["weather"] and out.finish_reason == "tool_calls"
    req, _ = generate(thinking, ['<think>x</think>[{"name":"weather","parameters":{"city":"P"}}]'],
                      tools=[WEATHER], tool_choice="required")
    assert req.sampling.reasoning_format == "deepseek_r1" and req.sampling.json_schema is not None
