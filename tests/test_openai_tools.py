"""Tool calling on /v1/chat/completions against a fake pipeline (tests/test_openai_api.HTTPPipeline)
that plays the model's text: what reaches the tokenizer (tools, tool calls and results in the
history, the constraint of `required` and a named function) and the response's shape, whole and
streamed, through the official `openai` client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from pipeserve.messages import ChatMessage
from pipeserve.tool_schema import required_schema
from tests.test_openai_api import HTTPPipeline

pytestmark = pytest.mark.timeout(60)

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}},
        "strict": True}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """A server with auto tool choice read as hermes."""
    pipeline = HTTPPipeline(str(tmp_path_factory.mktemp("tools")), enable_auto_tool_choice=True,
                            tool_call_parser="hermes")
    yield pipeline
    pipeline.close()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A server without auto tool choice."""
    pipeline = HTTPPipeline(str(tmp_path_factory.mktemp("plain")))
    yield pipeline
    pipeline.close()


def chat(api: HTTPPipeline, text: list[str], stream: bool = False, **kwargs: Any) -> tuple[Any, Any]:
    """A chat call answered with text (in these pieces); (the TokenizeRequest, the SDK's answer)."""

    def run() -> Any:
        out = api.openai.chat.completions.create(model="fake", stream=stream, **kwargs)
        return list(out) if stream else out

    future = api.call(run)
    req = api.next_request()
    api.serve([(t, [i + 1], "stop" if i == len(text) - 1 else "") for i, t in enumerate(text)], req.rid)
    return req, future.result(10)


def merged_calls(chunks: list[Any]) -> list[dict[str, str]]:
    """A stream's tool calls, their deltas merged by index as a client does."""
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or ():
            if d.id is not None:
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def test_tools_and_the_history_reach_the_chat_template(api):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    req, out = chat(api, ["It is sunny."], messages=history, tools=[WEATHER, TIME], tool_choice="none")
    assert req.tools == [WEATHER, TIME] and not req.sampling.constrained
    assert req.messages[1] == ChatMessage("assistant", "", history[1]["tool_calls"])
    assert req.messages[2] == ChatMessage("tool", "sunny", None, "call_1")
    message = out.choices[0].message
    assert message.content == "It is sunny." and not message.tool_calls
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_constrained_to_calls(api, parallel):
    text = '[{"name":"weather","parameters":{"city":"Paris"}},{"name":"time","parameters":{}}]'
    req, out = chat(api, [text], messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                    parallel_tool_calls=parallel)
    assert json.loads(req.sampling.json_schema) == required_schema([WEATHER["function"], TIME["function"]],
                                                                   parallel)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == (
        [("weather", {"city": "Paris"}), ("time", {})][: 2 if parallel else 1])
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_a_named_function_is_constrained_to_its_arguments_and_finishes_stop(api):
    named = {"type": "function", "function": {"name": "weather"}}
    req, out = chat(api, ['{"city":', '"Paris"}'], messages=USER, tools=[WEATHER, TIME], tool_choice=named)
    assert json.loads(req.sampling.json_schema) == WEATHER["function"]["parameters"]
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("weather", '{"city":"Paris"}')]
    _, chunks = chat(api, ['{"city":', '"Paris"}'], stream=True, messages=USER, tools=[WEATHER],
                     tool_choice=named)
    assert [(c["name"], c["arguments"]) for c in merged_calls(chunks)] == [("weather", '{"city":"Paris"}')]
    assert chunks[-1].choices[0].finish_reason == "stop"


HERMES = ['I will check. <tool', '_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>',
          '<tool_call>{"name": "time", "arguments": {}}</tool_call>']


def test_auto_parses_calls_out_of_the_text(api):
    req, out = chat(api, HERMES, messages=USER, tools=[WEATHER, TIME])  # tools alone: auto here
    assert not req.sampling.constrained
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check. "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("weather", {"city": "Paris"}), ("time", {})]
    _, out = chat(api, HERMES, messages=USER, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["weather"]
    _, out = chat(api, ["Just text."], messages=USER, tools=[WEATHER])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content == "Just text."
    assert not out.choices[0].message.tool_calls


def test_auto_streams_content_then_each_call(api):
    _, chunks = chat(api, HERMES, stream=True, messages=USER, tools=[WEATHER, TIME])
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "I will check. "
    calls = merged_calls(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("weather", {"city": "Paris"}),
                                                                        ("time", {})]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "nope"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools", "tools[0]"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", "response_format"),
    ],
)
def test_bad_tool_requests_are_400(plain, extra, param, words):
    body = {"model": "fake", "messages": USER, **extra}
    response = httpx.post(plain.url + "/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert plain.tokenize.poll(50) == 0


def test_tools_without_auto_tool_choice_mean_none(plain):
    req, out = chat(plain, ['<tool_call>{"name": "weather", "arguments": {}}</tool_call>'], messages=USER,
                    tools=[WEATHER])
    assert req.tools == [WEATHER] and not req.sampling.constrained
    assert out.choices[0].message.content.startswith("<tool_call>") and not out.choices[0].message.tool_calls
