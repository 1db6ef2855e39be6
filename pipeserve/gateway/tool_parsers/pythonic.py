"""Pythonic (Llama 3.2/4, ToolACE): the output is a Python list of calls with keyword arguments of
literal values, `[f(a=1), g(b="x")]`. Read with Python's own parser (ast), never evaluated."""

from __future__ import annotations

import ast
from typing import Any

from pipeserve.gateway.tool_parsers.base import ToolCall, ToolParser, arguments_text


class PythonicParser(ToolParser):
    def find_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("[") else None

    def hold(self, text: str) -> int:
        return len(text) if not text.strip() else 0  # undecided until the first character

    def parse_section(self, section: str) -> tuple[list[ToolCall], str] | None:
        try:
            tree = ast.parse(section.strip(), mode="eval")
        except SyntaxError:
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                args: dict[str, Any] = {str(k.arg): ast.literal_eval(k.value) for k in node.keywords}
            except ValueError:
                return None
            if any(k.arg is None for k in node.keywords):
                return None
            calls.append(ToolCall(node.func.id, arguments_text(args)))
        return calls, ""
