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


def streamed(name: str, text: str, step: int,
             max_calls: int | None = None) -> tuple[str, list[dict[str, str]]]:
    """(content, calls) of text fed in pieces of step characters, the call deltas merged."""
    stream = ToolStream(parser(name), max_calls)
    pieces = [stream.feed(text[i : i + step], i + step >= len(text)) for i in range(0, len(text), step)]
    calls: dict[int, dict[str, str]] = {}
    for d in (d for p in pieces for d in p.calls):
        if "id" in d:  # a call's first delta: index, id, type and name
            assert d["type"] == "function" and d["index"] not in calls
            calls[d["index"]] = {"name": d["function"]["name"], "arguments": "", "id": d["id"]}
        calls[d["index"]]["arguments"] += d["function"]["arguments"]
    assert [c["id"] for c in calls.values()] == [c.id for c in stream.calls]
    return "".join(p.content for p in pieces), list(calls.values())


# Cut short inside a call: whole it is content; streamed, hermes had announced the call (its name and
# the arguments so far went out as they came, as vLLM streams them), so it stays that call.
CUT_SHORT = CASES[2]


@pytest.mark.parametrize("name, text, content, calls", [c for c in CASES if c is not CUT_SHORT])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_equals_whole(name, text, content, calls, step):
    got_content, got = streamed(name, text, step)
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls
    whole = parser(name).parse(text)[1]
    assert [c["arguments"] for c in got] == [c.arguments for c in whole]  # the very text


@pytest.mark.parametrize("step", [1, 3])
def test_hermes_streams_arguments_as_they_are_written(step):
    text = ('Ok.<tool_call>{"name": "weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
            '<tool_call>{"arguments": {"zone": "utc"}, "name": "time"}</tool_call>')
    stream = ToolStream(parser("hermes"))
    deltas = []
    for i in range(0, len(text), step):
        deltas += [(i, d) for d in stream.feed(text[i : i + step], i + step >= len(text)).calls]
    first_close = text.index("</tool_call>")
    weather = [(i, d) for i, d in deltas if d["index"] == 0]
    assert weather[0][1]["function"]["name"] == "weather" and weather[0][0] < text.index('"city"')
    fragments = [d["function"]["arguments"] for i, d in weather[1:] if i < first_close]
    assert len(fragments) > 2  # out before the call closed, piece by piece
    assert "".join(d["function"]["arguments"] for _, d in weather) == '{"city": "Paris", "days": 2}'
    # Name not first: read whole at its end, arguments compact, as before.
    time_ = [d for _, d in deltas if d["index"] == 1]
    assert [d["function"].get("name") for d in time_ if "id" in d] == ["time"]
    assert "".join(d["function"]["arguments"] for d in time_) == '{"zone":"utc"}'


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_cut_short_while_written(step):
    name, text, content, _ = CUT_SHORT
    got_content, got = streamed(name, text, step)
    if step == 1000:  # the whole text at once, last: never announced, content as whole
        assert (got_content, got) == (content, [])
    else:
        assert got_content == "" and [c["name"] for c in got] == ["weather"]
        assert got[0]["arguments"] == '{"city":'


def test_hermes_at_most_max_calls_while_streaming():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    _, got = streamed("hermes", text, 1, max_calls=1)
    assert [(c["name"], c["arguments"]) for c in got] == [("a", '{"x": 1}')]


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
