"""--reasoning-parser over HTTP against a fake pipeline that plays the model's text: the reasoning
goes to message.reasoning (and reasoning_content), the rest to content, whole and streamed; tool
calls are read after it, and a structured-output constraint reaches the engine as one grammar that
starts after the reasoning section."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from pipeserve.messages import RequestError, encode
from tests.test_openai_api import HTTPPipeline
from tests.test_openai_tools import USER, WEATHER, chat, merged_calls

pytestmark = pytest.mark.timeout(60)

TEXT = ["<think>Paris is", " sunny.</th", "ink>\n\nIt is sunny."]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    pipeline = HTTPPipeline(str(tmp_path_factory.mktemp("reasoning")), reasoning_parser="deepseek_r1",
                            enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield pipeline
    pipeline.close()


def joined(chunks: list[Any], field: str) -> str:
    return "".join(getattr(c.choices[0].delta, field, None) or "" for c in chunks)


def test_reasoning_and_content_whole_and_streamed(api):
    _, out = chat(api, TEXT, messages=USER)
    message = out.choices[0].message
    assert message.reasoning == message.reasoning_content == "Paris is sunny."
    assert message.content == "\n\nIt is sunny." and out.choices[0].finish_reason == "stop"
    _, chunks = chat(api, TEXT, stream=True, messages=USER)
    assert joined(chunks, "reasoning") == joined(chunks, "reasoning_content") == "Paris is sunny."
    assert joined(chunks, "content") == "\n\nIt is sunny."
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "stop"
    first_content = next(i for i, c in enumerate(chunks) if c.choices[0].delta.content)
    assert all(not getattr(c.choices[0].delta, "reasoning", None) for c in chunks[first_content:])


def test_an_unfinished_reasoning_has_no_content(api):
    _, out = chat(api, ["still thinking"], messages=USER)
    assert out.choices[0].message.reasoning == "still thinking" and out.choices[0].message.content is None


def test_tool_calls_are_read_after_the_reasoning(api):
    text = ['<think>Use the tool.</think>', '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}',
            "</tool_call>"]
    _, out = chat(api, text, messages=USER, tools=[WEATHER])
    message = out.choices[0].message
    assert message.reasoning == "Use the tool." and message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("weather", {"city": "Paris"})]
    assert out.choices[0].finish_reason == "tool_calls"
    _, chunks = chat(api, text, stream=True, messages=USER, tools=[WEATHER])
    assert joined(chunks, "reasoning") == "Use the tool."
    assert [c["name"] for c in merged_calls(chunks)] == ["weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "extra, answer",
    [
        ({"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}, "yes"),
        ({"response_format": {"type": "json_object"}}, '{"a":1}'),
        ({"tools": [WEATHER], "tool_choice": "required"}, '[{"name":"weather","parameters":{"city":"P"}}]'),
    ],
)
def test_a_constraint_becomes_one_grammar_after_the_reasoning(api, extra, answer):
    req, _ = chat(api, ["<think>hm</think>", "yes"], messages=USER, **extra)
    s = req.sampling
    # The constraint travels as given, with the reasoning format: the engine builds the grammar.
    assert s.reasoning_format == "deepseek_r1" and s.constraint() is not None and s.grammar is None
    pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from pipeserve.grammar import params_grammar

    grammar = params_grammar(s)
    assert not _is_grammar_accept_string(grammar, answer)  # the reasoning section comes first
    assert _is_grammar_accept_string(grammar, "<think>hm</think>" + answer)
    assert _is_grammar_accept_string(grammar, "hm</think>" + answer)  # deepseek_r1: the prompt may open it


def test_an_invalid_constraint_is_still_refused_naming_it(api):
    """The engine builds the grammar after the reasoning: it refuses what does not compile (as any
    constraint), with the message the HTTP front end turns into a 400 naming the constraint; the
    gateway itself never imports xgrammar."""
    pytest.importorskip("xgrammar")
    from pipeserve.grammar import check_constraint
    from pipeserve.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="^regex is invalid"):
        check_constraint(SamplingParams(regex="(unclosed", reasoning_format="deepseek_r1"))
    body = {"model": "fake", "messages": USER, "structured_outputs": {"regex": "(unclosed"}}
    future = api.call(httpx.post, api.url + "/v1/chat/completions", json=body, timeout=30)
    request = api.next_request()
    assert request.sampling.reasoning_format == "deepseek_r1"
    api.errors.send(encode(RequestError(rid=request.rid, code="INVALID_ARGUMENT",
                                        message="regex is invalid: unbalanced parenthesis")))
    response = future.result(30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "regex", response.text
