"""Hermes (Qwen, NousResearch): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
number of them, with text allowed around them.

A call written name first (as the templates ask) keeps its arguments as the model wrote them (the
JSON text between `"arguments":` and the call's closing brace), so that streamed, where they go out
as they are generated (`partial_call`), they join to exactly what the whole output reads; a call in
another key order is read whole and its arguments written back compact."""

from __future__ import annotations

import json
import re

from pipeserve.gateway.tool_parsers.base import ToolCall, ToolParser, call_from, partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
# A call's beginning, name first: what must be read before its arguments can stream.
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def _raw_arguments(body: str, head: re.Match[str]) -> str:
    """The arguments text of a complete call body that starts with head: up to the call's closing
    brace (its last), whitespace trimmed."""
    return body[head.end() : body.rstrip().rfind("}")].rstrip()


class HermesParser(ToolParser):
    def find_start(self, text: str) -> int | None:
        start = text.find(OPEN)
        return None if start < 0 else start

    def hold(self, text: str) -> int:
        return partial_suffix(text, OPEN)

    def complete(self, section: str) -> int:
        end = section.rfind(CLOSE)
        return 0 if end < 0 else end + len(CLOSE)

    def partial_call(self, text: str) -> tuple[str, str] | None:
        start = text.find(OPEN)
        if start < 0:
            return None
        body = text[start + len(OPEN) :]
        head = HEAD.match(body)
        if head is None:
            return None
        name = json.loads(head.group(1))
        # Final so far: up to the last brace seen (it may be the call's own), trailing space held.
        tail = body[head.end() :]
        brace = tail.rfind("}")
        return name, (tail if brace < 0 else tail[:brace]).rstrip()

    def parse_section(self, section: str) -> tuple[list[ToolCall], str] | None:
        calls, rest, position = [], [], 0
        for match in CALL.finditer(section):
            rest.append(section[position : match.start()])
            position = match.end()
            body = match.group(1)
            try:
                call = call_from(json.loads(body.strip()), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return None
            head = HEAD.match(body)
            if head is not None:
                raw = _raw_arguments(body, head)
                try:
                    if json.loads(raw) == json.loads(call.arguments):
                        call.arguments = raw
                except json.JSONDecodeError:
                    pass
            calls.append(call)
        rest.append(section[position:])
        return (calls, "".join(rest)) if calls else None
