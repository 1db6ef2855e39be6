"""The tool-call parsers (pipeserve/gateway/tool_parsers/): each format read whole, and streamed in
every split (one character at a time) to the same content and calls; what is not the format stays
content."""

from __future__ import annotations

import json

import pytest

from pipeserve.config import TOOL_CALL_PARSERS
from pipeserve.gateway.tool_parsers import PARSERS, JsonListParser, ToolParser, ToolStream

W = {"city": "Paris", "days": 2}
CASES = [
    ("hermes", 'Let me look.<tool_call>{"name": "weather", "arguments": {"city": "Paris", "days": 2}}'
               '</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>',
     "Let me look.\n", [("weather", W), ("time", {})]),
    ("hermes", "No calls here < tool_call >", "No calls here < tool_call >", []),
    ("hermes", '<tool_call>{"name": "weather", "arguments": {"city": ', '<tool_call>{"name": "weather", '
               '"arguments": {"city": ', []),  # cut short: content, as vLLM
    ("llama3_json", '{"name": "weather", "parameters": {"city": "Paris", "days": 2}}', "", [("weather", W)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
     "", [("a", {}), ("b", {"x": 1})]),
    ("llama3_json", "Paris is {sunny}", "Paris is {sunny}", []),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris", "days": 2}}]',
     "Sure. ", [("weather", W)]),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ("pythonic", '[weather(city="Paris", days=2), time()]', "", [("weather", W), ("time", {})]),
    ("pythonic", "[1, 2] are numbers", "[1, 2] are numbers", []),
    ("pythonic", '[weather(city=open("x"))]', '[weather(city=open("x"))]', []),  # never evaluated
]


def parser(name: str) -> ToolParser:
    return JsonListParser() if name == "json_list" else PARSERS[name]()


def test_every_configurable_parser_exists():
    assert tuple(PARSERS) == TOOL_CALL_PARSERS


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole(name, text, content, calls):
    got_content, got = parser(name).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got) and all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("name, text, content, calls", CASES)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_equals_whole(name, text, content, calls, step):
    stream = ToolStream(parser(name))
    pieces = [stream.feed(text[i : i + step], i + step >= len(text)) for i in range(0, len(text), step)]
    assert "".join(p.content for p in pieces) == content
    deltas = [d for p in pieces for d in p.calls]
    streamed: dict[int, dict[str, str]] = {}
    for d in deltas:
        if "id" in d:  # a call's first delta: index, id, type and name
            assert d["type"] == "function" and d["index"] not in streamed
            streamed[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
        streamed[d["index"]]["arguments"] += d["function"]["arguments"]
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == calls


def test_content_streams_before_the_calls_and_a_partial_marker_is_held():
    stream = ToolStream(parser("hermes"))
    assert stream.feed("Hello <tool", False).content == "Hello "
    piece = stream.feed('_call>{"name": "f", "arguments": {}}</tool_call>', False)
    assert piece.content == "" and piece.calls[0]["function"]["name"] == "f"  # out when complete
    assert stream.feed(" bye", True).content == " bye"


def test_at_most_max_calls():
    stream = ToolStream(parser("pythonic"), max_calls=1)
    piece = stream.feed("[a(x=1), b(y=2)]", True)
    assert [d["function"].get("name") for d in piece.calls if "id" in d] == ["a"]


def test_json_list_is_the_required_format():
    content, calls = parser("json_list").parse('[{"name":"f","parameters":{"a":1}}]')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"a":1}')]
