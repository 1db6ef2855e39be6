"""OpenAI's Responses API (`POST /v1/responses`), stateless: a request is a chat conversation (its
`input` and `instructions` rendered by the chat template exactly as /v1/chat/completions renders the
same messages), served through the gateway's core like a chat completion, with its answer as
output items: `reasoning` (under --reasoning-parser), `message` (output_text) and `function_call`.
`function_call` and `function_call_output` input items continue a conversation. Nothing is stored:
`store: true` and `previous_response_id` are refused with a 400 naming them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field

from pipeserve.config import GatewayConfig
from pipeserve.gateway.http_common import PARAM, HTTPError, RequestBody, from_refusal, until_disconnect
from pipeserve.gateway.openai_fields import RESPONSES_REFUSED, Rule, first_refused
from pipeserve.gateway.reasoning import PARSERS as REASONING_PARSERS
from pipeserve.gateway.requests import MAX_TOKEN_ID, Core, Refusal, Stream
from pipeserve.gateway.tool_calls import chat_sampling, plan_tools
from pipeserve.gateway.tool_parsers import ToolCall
from pipeserve.messages import ChatMessage

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(RequestBody):
    model_config = ConfigDict(extra="allow")  # kept only to refuse the meaningful ones
    REFUSED: ClassVar[dict[str, Rule]] = RESPONSES_REFUSED

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_ID)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)  # as on chat completions (an extension here)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        name = first_refused(self.model_extra, self.REFUSED)
        if name == "store" or name == "previous_response_id":
            raise HTTPError(400, f"{name}: this server keeps no responses (stateless); send the whole "
                                 "conversation as input", name, "unsupported_parameter")
        if name is not None:
            raise HTTPError(400, f"{name} is not supported by this server", name, "unsupported_parameter")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({"type": "function", "name", "parameters", ...}) as chat's."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise HTTPError(400, f"tools[{i}]: only function tools are supported", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise HTTPError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                 '"name": ...}', "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise HTTPError(400, f"{where}: content must be text or a list of text parts", "input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            raise HTTPError(400, f"{where}: only text content parts are supported", "input")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def messages_of(body: ResponsesRequest) -> list[ChatMessage]:
    """The conversation: instructions as the system message, then the input items."""
    messages = [ChatMessage("system", body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [ChatMessage("user", body.input)]
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            messages.append(ChatMessage(str(item.get("role", "")), _text(item.get("content"), where)))
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if not all(isinstance(v, str) for v in (call["id"], item.get("name"), item.get("arguments", ""))):
                raise HTTPError(400, f"{where}: a function_call needs call_id, name and arguments", "input")
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # the calls of one turn: one message
                last.tool_calls = (last.tool_calls or []) + [call]
            else:
                messages.append(ChatMessage("assistant", "", [call]))
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise HTTPError(400, f"{where}: a function_call_output needs call_id", "input")
            messages.append(ChatMessage("tool", _text(output if output is not None else "", where), None,
                                        item["call_id"]))
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: chat templates leave it out of the history
        else:
            raise HTTPError(400, f"{where}: input items of type {kind!r} are not supported", "input")
    return messages


def text_format(text: dict[str, Any] | None) -> dict[str, Any]:
    """text.format as SamplingParams constraint fields."""
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"json_schema": json.dumps(fmt["schema"])}
    raise HTTPError(400, 'text.format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                         '"json_schema", "name": ..., "schema": {...}}', "text")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Output:
    """A response's output items as they are built, and the events that build them when streamed."""

    items: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    open: dict[str, Any] | None = None  # the item being streamed

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": f"response.{kind}"} | fields)

    def _start(self, item: dict[str, Any]) -> None:
        self.close()
        self.items.append(item)
        self.open = item
        self._event("output_item.added", output_index=len(self.items) - 1, item=_pending(item))

    def reasoning(self, text: str) -> None:
        if self.open is None or self.open["type"] != "reasoning":
            self._start({"type": "reasoning", "id": _id("rs"), "summary": [],
                         "content": [{"type": "reasoning_text", "text": ""}], "status": "completed"})
        assert self.open is not None
        self.open["content"][0]["text"] += text
        self._event("reasoning_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                    content_index=0, delta=text)

    def text(self, text: str) -> None:
        if self.open is None or self.open["type"] != "message":
            self._start({"type": "message", "id": _id("msg"), "role": "assistant", "status": "completed",
                         "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]})
            assert self.open is not None
            self._event("content_part.added", item_id=self.open["id"], output_index=len(self.items) - 1,
                        content_index=0, part=self.open["content"][0] | {"text": ""})
        assert self.open is not None
        self.open["content"][0]["text"] += text
        self._event("output_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                    content_index=0, delta=text, logprobs=[])

    def call(self, index: int, delta: dict[str, Any]) -> None:
        """A tool-call delta of the chat stream (its first: id and name; then argument fragments)."""
        if "id" in delta:
            self._start({"type": "function_call", "id": _id("fc"), "call_id": delta["id"],
                         "name": delta["function"]["name"], "arguments": "", "status": "completed"})
        assert self.open is not None and self.open["type"] == "function_call"
        fragment = delta["function"].get("arguments") or ""
        if fragment:
            self.open["arguments"] += fragment
            self._event("function_call_arguments.delta", item_id=self.open["id"],
                        output_index=len(self.items) - 1, delta=fragment)

    def close(self) -> None:
        """End the item being streamed with its done events."""
        item, self.open = self.open, None
        if item is None:
            return
        index = len(self.items) - 1
        if item["type"] == "reasoning":
            self._event("reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=item["content"][0]["text"])
        elif item["type"] == "message":
            part = item["content"][0]
            self._event("output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=[])
            self._event("content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part)
        else:
            self._event("function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"])
        self._event("output_item.done", output_index=index, item=item)

    def take(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


def _pending(item: dict[str, Any]) -> dict[str, Any]:
    """An item as announced before its content streams."""
    out = item | {"status": "in_progress"}
    if item["type"] == "message":
        out["content"] = []
    elif item["type"] == "reasoning":
        out["content"] = []
    return out


class Responses:
    """The /v1/responses endpoint of one OpenAI front end."""

    def __init__(self, core: Core, config: GatewayConfig,
                 model: Callable[[str | None], tuple[str, str]]) -> None:
        """model: the body's model field -> (the model the response names, the LoRA adapter it runs:
        "" for the base model), as the other OpenAI endpoints resolve it."""
        self.core, self.config, self.model = core, config, model

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        model, lora = self.model(body.model)
        messages = messages_of(body)
        if not messages:
            raise HTTPError(400, "input must not be empty", "input")
        tools = chat_tools(body.tools)
        given: dict[str, Any] = {"temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
                                 "max_tokens": body.max_output_tokens} | text_format(body.text)
        reasoning = self.config.reasoning_parser
        try:
            choice = chat_tool_choice(body.tool_choice)
            plan = plan_tools(tools, choice, body.parallel_tool_calls, self.config)
            given = chat_sampling(given, plan, reasoning)
        except ValueError as exc:
            match = PARAM.match(str(exc))
            raise HTTPError(400, str(exc), match.group(1) if match else "tools") from None
        rid = _id("resp")
        fit = body.max_output_tokens is None
        try:
            params = self.core.sampling(given, fit)
            (stream,) = await self.core.submit(params, messages, rid, fit_max_tokens=fit,
                                               tools=plan.tools if plan else None, lora=lora)
        except Refusal as refusal:
            raise from_refusal(refusal) from None
        turn = Turn(body, model, rid, stream, plan.output() if plan else None,
                    REASONING_PARSERS[reasoning]() if reasoning else None)
        if body.stream:
            return StreamingResponse(self._events(turn), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            await until_disconnect(request, self._collect(turn))
        except Refusal as refusal:
            raise from_refusal(refusal) from None
        finally:
            self.core.close(stream)
        return JSONResponse(turn.response("completed"))

    async def _collect(self, turn: Turn) -> None:
        text = []
        async for rows, _ in self.core.output(turn.stream):
            text += [r.text for r in rows]
        turn.whole("".join(text))

    async def _events(self, turn: Turn) -> AsyncIterator[bytes]:
        """The event stream: created, in_progress, the items' events, then completed (or
        incomplete: cut at max_output_tokens; failed: the pipeline failed)."""
        sequence = 0

        def sse(event: dict[str, Any]) -> bytes:
            nonlocal sequence
            event["sequence_number"] = sequence
            sequence += 1
            data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
            return f"event: {event['type']}\ndata: {data}\n\n".encode()

        yield sse({"type": "response.created", "response": turn.response("in_progress")})
        yield sse({"type": "response.in_progress", "response": turn.response("in_progress")})
        try:
            async for rows, last in self.core.output(turn.stream):
                for event in turn.feed("".join(r.text for r in rows), last):
                    yield sse(event)
        except Refusal as refusal:
            error = from_refusal(refusal).body()["error"]
            failure = {"code": error["code"], "message": error["message"]}
            response = turn.response("failed") | {"error": failure}
            yield sse({"type": "response.failed", "response": response})
            return
        finally:
            self.core.close(turn.stream)
        status = turn.status()
        yield sse({"type": f"response.{status}", "response": turn.response(status)})


@dataclass
class Turn:
    """One response being made: its stream and how its text becomes output items."""

    body: ResponsesRequest
    model: str
    rid: str
    stream: Stream
    tools: Any  # ToolOutput | None
    reasoning: Any  # ReasoningParser | None
    output: Output = field(default_factory=Output)
    created: int = field(default_factory=lambda: int(time.time()))

    def whole(self, text: str) -> None:
        """The output items of a whole text."""
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.parse(text)
            if reasoning is not None:
                self.output.reasoning(reasoning)
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls, _ = self.tools.whole(content or "", self.stream.finish)
        if content or not calls:
            self.output.text(content or "")
        for i, call in enumerate(calls):
            self.output.call(i, {"id": call.id, "function": {"name": call.name, "arguments": call.arguments}})
        self.output.close()
        self.output.take()

    def feed(self, text: str, last: bool) -> list[dict[str, Any]]:
        """The events of new text of a streamed response (last: it ended)."""
        if self.reasoning is not None:
            split = self.reasoning.feed(text, last)
            if split.reasoning:
                self.output.reasoning(split.reasoning)
            text = split.content
        if self.tools is not None:
            piece = self.tools.feed(text, last)
            if piece.content:
                self.output.text(piece.content)
            for delta in piece.calls:
                self.output.call(delta["index"], delta)
        elif text:
            self.output.text(text)
        if last:
            if not self.output.items:
                self.output.text("")
            self.output.close()
        return self.output.take()

    def status(self) -> str:
        return "incomplete" if self.stream.finish == "length" else "completed"

    def response(self, status: str) -> dict[str, Any]:
        body = self.body
        fmt = (body.text or {}).get("format") or {"type": "text"}
        done = status not in ("in_progress",)
        if status == "completed":
            status = self.status()
        prompt, completion = self.stream.prompt_tokens, self.stream.completion_tokens
        usage = {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
                 "input_tokens_details": {"cached_tokens": self.stream.cached_prompt_tokens},
                 "output_tokens_details": {"reasoning_tokens": 0}}
        choice = body.tool_choice if body.tool_choice is not None else "auto" if self.tools else "none"
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "model": self.model,
            "status": status, "output": self.output.items if done else [],
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p, "tool_choice": choice,
            "tools": body.tools or [], "text": {"format": fmt}, "previous_response_id": None,
            "reasoning": None, "store": False, "truncation": "disabled", "user": body.user,
            "usage": usage if done else None,
        }

