"""/v1/responses against a fake pipeline that plays the model's text, through the official `openai`
client: the conversation the tokenizer gets (instructions, input items, function calls and their
outputs), output items whole and as stream events, and what is refused."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from pipeserve.messages import ChatMessage
from tests.test_openai_api import HTTPPipeline

pytestmark = pytest.mark.timeout(60)

WEATHER = {"type": "function", "name": "weather", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    pipeline = HTTPPipeline(str(tmp_path_factory.mktemp("responses")), enable_auto_tool_choice=True,
                            tool_call_parser="hermes", reasoning_parser="qwen3")
    yield pipeline
    pipeline.close()


def respond(api: HTTPPipeline, answer: list[str], finish: str = "stop", stream: bool = False,
            **kwargs: Any) -> tuple[Any, Any]:
    def run() -> Any:
        out = api.openai.responses.create(model="fake", stream=stream, **kwargs)
        return list(out) if stream else out

    future = api.call(run)
    req = api.next_request()
    api.serve([(t, [i + 1], finish if i == len(answer) - 1 else "") for i, t in enumerate(answer)], req.rid)
    return req, future.result(10)


def test_text(api):
    req, out = respond(api, ["Hello", " there."], input="Hi", instructions="Be brief.", max_output_tokens=9,
                       temperature=0.5)
    assert req.messages == [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
    assert (req.sampling.max_tokens, req.sampling.temperature) == (9, 0.5) and not req.fit_max_tokens
    assert out.status == "completed" and out.output_text == "Hello there." and out.id.startswith("resp_")
    assert [item.type for item in out.output] == ["message"]
    assert (out.usage.input_tokens, out.usage.output_tokens) == (3, 2)
    _, cut = respond(api, ["Hello"], finish="length", input="Hi")
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_stream_events(api):
    _, events = respond(api, ["<think>hm</think>", "Hello", " there."], stream=True, input="Hi")
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there."
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "hm"
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == "Hello there."
    assert final.output[0].content[0].text == "hm"
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == done == ["reasoning", "message"]


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip(api, stream):
    _, out = respond(api, [CALL], stream=stream, input="Weather in Paris?", tools=[WEATHER])
    if stream:
        events = out
        # hermes keeps the arguments as the model wrote them, streamed as they come
        assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == (
            '{"city": "Paris"}')
        out = events[-1].response
        assert [i.arguments for i in out.output if i.type == "function_call"] == ['{"city": "Paris"}']
    (call,) = [item for item in out.output if item.type == "function_call"]
    assert call.name == "weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    history = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    req, answer = respond(api, ["It is sunny."], input=history, tools=[WEATHER])
    function = {"name": "weather", "arguments": call.arguments}
    assert req.messages[1].role == "assistant" and req.messages[1].tool_calls == [
        {"id": call.call_id, "type": "function", "function": function}]
    assert req.messages[2] == ChatMessage("tool", "sunny", None, call.call_id)
    assert answer.output_text == "It is sunny."


def test_required_and_text_format_constrain(api):
    req, _ = respond(api, ["{}"], input="x", text={"format": {"type": "json_schema", "name": "o",
                                                             "schema": {"type": "object"}}})
    # Under the reasoning parser: the engine builds one grammar, the section then the constraint.
    assert req.sampling.json_schema and req.sampling.reasoning_format == "qwen3"
    req, out = respond(api, ['[{"name":"weather","parameters":{"city":"P"}}]'], input="x", tools=[WEATHER],
                       tool_choice="required")
    assert req.sampling.json_schema and req.sampling.reasoning_format == "qwen3"
    assert [i.type for i in out.output] == ["function_call"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"text": {"format": {"type": "yaml"}}}, "text"),
    ],
)
def test_refused(api, extra, param):
    body = {"model": "fake", "input": "x", **extra}
    response = httpx.post(api.url + "/v1/responses", json=body, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert api.tokenize.poll(50) == 0


def test_accepted_and_harmless(api):
    _, out = respond(api, ["ok"], input="x", store=False, metadata={"k": "v"}, user="u",
                     truncation="disabled")
    assert out.output_text == "ok" and out.metadata == {"k": "v"} and out.store is False
