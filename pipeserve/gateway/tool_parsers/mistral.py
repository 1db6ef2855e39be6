"""Mistral: `[TOOL_CALLS]` followed by a JSON list of `{"name": ..., "arguments": {...}}`; text
before the marker is content."""

from __future__ import annotations

import json

from pipeserve.gateway.tool_parsers.base import ToolCall, ToolParser, call_from, partial_suffix

MARKER = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    def find_start(self, text: str) -> int | None:
        start = text.find(MARKER)
        return None if start < 0 else start

    def hold(self, text: str) -> int:
        return partial_suffix(text, MARKER)

    def parse_section(self, section: str) -> tuple[list[ToolCall], str] | None:
        body = section.removeprefix(MARKER).strip()
        try:
            obj, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        calls = [call_from(item, "arguments") for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None], body[end:].strip()
