"""Tool calling on chat completions, as vLLM serves it: what a request's `tools`, `tool_choice` and
`parallel_tool_calls` mean (ToolPlan: validated once per request), the constraint that enforces
`required` and a named function (pipeserve/tool_schema.py), and each choice's output read as
OpenAI's `tool_calls`, whole or streamed (ToolOutput).

- `none`: plain text (the tools are still rendered in the prompt, as OpenAI and vLLM do).
- `auto`: the model decides; its text is read by `--tool-call-parser` (tool_parsers/), which needs
  `--enable-auto-tool-choice`. finish_reason `tool_calls` when it called any.
- `required`: the output is constrained to a JSON list of calls; finish_reason `tool_calls`.
- a named function: the output is constrained to its arguments; finish_reason is the engine's
  (`stop`), as OpenAI.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pipeserve.config import GatewayConfig
from pipeserve.gateway.reasoning import ReasoningParser
from pipeserve.gateway.reasoning.constraint import constrain_after_reasoning
from pipeserve.gateway.tool_parsers import (
    PARSERS,
    JsonListParser,
    StreamPiece,
    ToolCall,
    ToolParser,
    ToolStream,
)
from pipeserve.sampling_params import CONSTRAINTS
from pipeserve.tool_schema import parameters_schema, required_schema

TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class ToolPlan:
    """A request's tools and what its tool_choice asks."""

    mode: str  # none, auto, required or named
    tools: list[dict[str, Any]]  # as the client sent them: the chat template renders these
    functions: list[dict[str, Any]]  # their function definitions
    parallel: bool = True
    name: str = ""  # named: the function
    parser: type[ToolParser] | None = None  # auto: the configured format

    def constraint(self) -> dict[str, Any]:
        """The SamplingParams constraint enforcing the choice (none for none and auto)."""
        if self.mode == "required":
            return {"json_schema": json.dumps(required_schema(self.functions, self.parallel))}
        if self.mode == "named":
            function = next(f for f in self.functions if f["name"] == self.name)
            return {"json_schema": json.dumps(parameters_schema(function))}
        return {}

    def output(self) -> ToolOutput | None:
        """A choice's reader of calls (None: its text is plain content)."""
        return None if self.mode == "none" else ToolOutput(self)


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel: bool | None, config: GatewayConfig) -> ToolPlan | None:
    """The request's plan (None without tools); ValueError naming the field at fault."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name, parameters = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        functions.append(function)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    plan = ToolPlan("none", tools, functions, parallel is not False)
    if tool_choice is None:
        tool_choice = "auto" if config.enable_auto_tool_choice else "none"
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError('tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}')
        if name not in names:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
        plan.mode, plan.name = "named", name
    elif tool_choice not in TOOL_CHOICES:
        raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, "
                         f"got {tool_choice!r}")
    else:
        plan.mode = tool_choice
    if plan.mode == "auto":
        if not config.enable_auto_tool_choice or config.tool_call_parser is None:
            raise ValueError('tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                             "and --tool-call-parser")
        plan.parser = PARSERS[config.tool_call_parser]
    return plan


def chat_sampling(given: dict[str, Any], plan: ToolPlan | None, reasoning: str | None) -> dict[str, Any]:
    """A chat request's SamplingParams fields with the constraint its tool choice needs (required, a
    named function) and, under a reasoning parser, any constraint applying after the reasoning
    section: what every front end sends (HTTP chat and responses, gRPC). ValueError naming
    tool_choice when the choice and another constraint both constrain the output."""
    if plan is not None and plan.constraint():
        if any(given.get(name) not in (None, False) for name in CONSTRAINTS):
            raise ValueError(f'tool_choice "{plan.mode}" constrains the output: it cannot be combined with '
                             "another structured-output constraint (response_format, structured_outputs, "
                             "text.format)")
        given = given | plan.constraint()
    return constrain_after_reasoning(reasoning, given) if reasoning is not None else given


@dataclass
class ChatAnswer:
    """A whole chat output read as OpenAI's message: reasoning, content and calls (None: none)."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall]
    finish: str


def read_answer(text: str, finish: str, tools: ToolOutput | None,
                reasoning: ReasoningParser | None) -> ChatAnswer:
    """The reasoning split off first (under a reasoning parser), then the calls read out of the
    content (with tools)."""
    thought, content = reasoning.parse(text) if reasoning is not None else (None, text)
    calls: list[ToolCall] = []
    if tools is not None:
        content, calls, finish = tools.whole(content or "", finish)
    return ChatAnswer(thought, content, calls, finish)


@dataclass
class ToolOutput:
    """One choice's text read as tool calls: whole (whole()) or as it streams (feed())."""

    plan: ToolPlan
    stream: ToolStream | None = None
    calls: list[ToolCall] = field(default_factory=list)  # streamed so far

    def __post_init__(self) -> None:
        if self.plan.mode != "named":
            parser = self.plan.parser() if self.plan.parser is not None else JsonListParser()
            self.stream = ToolStream(parser, None if self.plan.parallel else 1)

    def whole(self, text: str, finish: str) -> tuple[str | None, list[ToolCall], str]:
        """(content, calls, finish_reason) of a whole output."""
        if self.plan.mode == "named":
            return None, [ToolCall(self.plan.name, text)], finish
        assert self.stream is not None
        content, calls = self.stream.parser.parse(text)
        calls = calls if self.plan.parallel else calls[:1]
        return content or None, calls, "tool_calls" if calls else finish

    def feed(self, text: str, last: bool) -> StreamPiece:
        """The stream deltas of new text (last: the output ended)."""
        if self.plan.mode == "named":  # the whole output is the arguments: they stream as they come
            piece = StreamPiece()
            if not self.calls:
                self.calls.append(ToolCall(self.plan.name, ""))
                call = self.calls[0]
                piece.calls.append({"index": 0, "id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": ""}})
            if text:
                piece.calls.append({"index": 0, "function": {"arguments": text}})
            return piece
        assert self.stream is not None
        piece = self.stream.feed(text, last)
        self.calls = self.stream.calls
        return piece

    def finish(self, finish: str) -> str:
        """The streamed finish_reason."""
        return "tool_calls" if self.calls and self.plan.mode != "named" else finish
