"""The reasoning parsers (pipeserve/gateway/reasoning/) whole and streamed in every split, and the
grammar that lets a constraint start only after the reasoning section (pipeserve/reasoning.py,
pipeserve/grammar.after_reasoning), checked with xgrammar's own matcher."""

from __future__ import annotations

import pytest

from pipeserve.config import REASONING_PARSERS
from pipeserve.gateway.reasoning import PARSERS

CASES = [
    ("deepseek_r1", "<think>Let me see.</think>\n\nYes.", "Let me see.", "\n\nYes."),
    ("deepseek_r1", "opened by the template</think>Yes.", "opened by the template", "Yes."),
    ("deepseek_r1", "no end: all reasoning", "no end: all reasoning", None),
    ("deepseek_r1", "a <thi</think>b</think>c", "a <thi", "b</think>c"),
    ("qwen3", "<think>Let me see.</think>\n\nYes.", "Let me see.", "\n\nYes."),
    ("qwen3", "thinking off</think>Yes.", None, "thinking off</think>Yes."),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "<think>cut short", "cut short", None),
]


def test_every_configurable_parser_exists():
    assert tuple(PARSERS) == REASONING_PARSERS


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_whole_and_streamed(name, text, reasoning, content, step):
    assert PARSERS[name]().parse(text) == (reasoning, content)
    parser = PARSERS[name]()
    pieces = [parser.feed(text[i : i + step], i + step >= len(text)) for i in range(0, len(text), step)]
    assert "".join(p.reasoning for p in pieces) == (reasoning or "")
    assert "".join(p.content for p in pieces) == (content or "")


def test_reasoning_streams_before_its_end_and_a_partial_tag_is_held():
    parser = PARSERS["deepseek_r1"]()
    assert parser.feed("<think>abc</th", False).reasoning == "abc"
    split = parser.feed("ink>done", False)
    assert (split.reasoning, split.content) == ("", "done")


@pytest.mark.parametrize(
    "name, text, accepted",
    [
        ("deepseek_r1", "<think>hm</think>ab", True),
        ("deepseek_r1", "hm</think>ab", True),
        ("deepseek_r1", "a<</think>b", True),
        ("deepseek_r1", "a</thi</think>b", True),
        ("deepseek_r1", "ab", False),  # the section must end before the constraint applies
        ("deepseek_r1", "a</think>c</think>ab", False),  # after it, only the constraint
        ("deepseek_r1", "hm</think>abc", False),
        ("qwen3", "<think>hm</think>ab", True),
        ("qwen3", "ab", True),
        ("qwen3", "hm</think>ab", False),
    ],
)
def test_constraint_applies_after_the_reasoning(name, text, accepted):
    pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from pipeserve.grammar import after_reasoning

    grammar = after_reasoning(name, "regex", "[ab]{1,2}")
    assert _is_grammar_accept_string(grammar, text) is accepted
