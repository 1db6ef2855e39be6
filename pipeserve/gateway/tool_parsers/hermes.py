"""Hermes (Qwen, NousResearch): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
number of them, with text allowed around them."""

from __future__ import annotations

import json
import re

from pipeserve.gateway.tool_parsers.base import ToolCall, ToolParser, call_from, partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesParser(ToolParser):
    def find_start(self, text: str) -> int | None:
        start = text.find(OPEN)
        return None if start < 0 else start

    def hold(self, text: str) -> int:
        return partial_suffix(text, OPEN)

    def complete(self, section: str) -> int:
        end = section.rfind(CLOSE)
        return 0 if end < 0 else end + len(CLOSE)

    def parse_section(self, section: str) -> tuple[list[ToolCall], str] | None:
        calls, rest, position = [], [], 0
        for match in CALL.finditer(section):
            rest.append(section[position : match.start()])
            position = match.end()
            try:
                call = call_from(json.loads(match.group(1).strip()), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return None
            calls.append(call)
        rest.append(section[position:])
        return (calls, "".join(rest)) if calls else None
