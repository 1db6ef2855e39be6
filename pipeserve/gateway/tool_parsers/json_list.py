"""The format `tool_choice: "required"` constrains the output to (pipeserve/tool_schema.py): a JSON
list of `{"name": ..., "parameters": {...}}`."""

from __future__ import annotations

import json

from pipeserve.gateway.tool_parsers.base import ToolCall, ToolParser, call_from


class JsonListParser(ToolParser):
    def find_start(self, text: str) -> int | None:
        return 0

    def hold(self, text: str) -> int:
        return 0

    def parse_section(self, section: str) -> tuple[list[ToolCall], str] | None:
        try:
            items = json.loads(section)
        except json.JSONDecodeError:
            return None
        if not isinstance(items, list):
            return None
        calls = [call_from(item, "parameters") for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None], ""
