"""Qwen3: reasoning is only the text between `<think>` and `</think>` at the start of the output;
an output that does not open with `<think>` is all content (thinking off). One cut short inside the
section is all reasoning, as it streamed."""

from __future__ import annotations

from pipeserve.gateway.reasoning.base import ReasoningParser


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
