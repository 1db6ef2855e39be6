"""Llama 3.x JSON tool calls: the output is a JSON object `{"name": ..., "parameters": {...}}`
(optionally after `<|python_tag|>`; several separated by `;`). Text that does not begin with one
is content."""

from __future__ import annotations

import json

from pipeserve.gateway.tool_parsers.base import ToolCall, ToolParser, call_from

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    def find_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def hold(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if PYTHON_TAG.startswith(stripped) else 0  # undecided until the first character

    def parse_section(self, section: str) -> tuple[list[ToolCall], str] | None:
        body = section.strip().removeprefix(PYTHON_TAG).strip()
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            try:
                obj, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return None
            call = call_from(obj, "parameters")
            if call is None:
                return None
            calls.append(call)
            while position < len(body) and body[position] in " \n\t;":
                position += 1
        return (calls, "") if calls else None
