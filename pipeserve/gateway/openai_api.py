"""The OpenAI-compatible HTTP API (`--http-port`): FastAPI served by uvicorn on the gateway's own
event loop, a thin front end over the gateway's core (gateway/requests.py: admission, limits,
streams, aborts and metrics are shared with gRPC). It imports nothing of gRPC or protobuf.

An OpenAI request becomes SamplingParams and a Prompt and goes through the core's one validation,
so every parameter is checked once whichever front end received it. Errors use OpenAI's body
{"error": {"message", "type", "param", "code"}}: 400 for an invalid parameter (a pydantic
validation error too, never a bare 422), 401 without the API key, 404 for an unknown model, 503
with Retry-After when over capacity or not serving. Streams are server-sent events
`data: {json}\\n\\n` ending with `data: [DONE]`. A streamed request's response starts only with its
first output, so a refusal decided in the pipeline before any token (a prompt too long for the
context, no chat template) is an HTTP error like the same request without streaming; a failure
after the stream began is a `data: {"error": ...}` event. A client that disconnects aborts its
requests in the engine; disconnects are normal and logged at debug level only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import numpy as np
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pipeserve.config import EngineConfig, GatewayConfig
from pipeserve.gateway.embeddings_api import EmbeddingRequest, Embeddings
from pipeserve.gateway.http_common import (
    CLIENT_CLOSED,
    PARAM,
    ROUTING_CODES,
    Disconnected,
    HTTPError,
    RequestBody,
    from_refusal,
    invalid_body,
    until_disconnect,
)
from pipeserve.gateway.http_limits import uvicorn_options
from pipeserve.gateway.openai_fields import (
    CHAT_REFUSED,
    COMPLETION_REFUSED,
    MESSAGE_REFUSED,
    Rule,
    first_refused,
)
from pipeserve.gateway.reasoning import PARSERS as REASONING_PARSERS
from pipeserve.gateway.reasoning import ReasoningParser
from pipeserve.gateway.rendered_json import Logprobs, dumps
from pipeserve.gateway.requests import MAX_TOKEN_ID, Core, Delta, ErrorCode, Prompt, Refusal, Stream
from pipeserve.gateway.responses_api import Responses, ResponsesRequest
from pipeserve.gateway.tool_calls import ToolOutput, ToolPlan, chat_sampling, plan_tools, read_answer
from pipeserve.lora import LoRAError
from pipeserve.messages import ChatMessage

log = logging.getLogger("pipeserve.gateway.http")

MAX_N = 128
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]  # what the int32 wire fields can hold


# ---- request bodies --------------------------------------------------------------------------------


B = TypeVar("B", bound=RequestBody)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint; a field it does not know is a 400."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def params(self) -> dict[str, Any]:
        """The SamplingParams constraint it sets."""
        given = {name: value for name, value in (("json_schema", self.json_), ("regex", self.regex),
                                                 ("choice", self.choice), ("grammar", self.grammar),
                                                 ("json_object", self.json_object or None))
                 if value is not None}
        if len(given) != 1:
            raise HTTPError(400, "structured_outputs must set exactly one of json, regex, choice, grammar, "
                                 f"json_object; got {len(given)}", "structured_outputs")
        return given


class Sampling(RequestBody):
    """The parameters both endpoints share (OpenAI's and vLLM's extra sampling fields). Fields it
    does not declare are kept (extra="allow") only to refuse the meaningful ones (REFUSED)."""

    model_config = ConfigDict(extra="allow")
    REFUSED: ClassVar[dict[str, Rule]] = COMPLETION_REFUSED

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-MAX_TOKEN_ID, le=MAX_TOKEN_ID)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0, le=MAX_TOKEN_ID)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    cache_salt: str = ""
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # vLLM's: lower runs sooner (priority scheduling only)
    user: str | None = None
    return_token_ids: bool = False  # vLLM's extension: the generated ids beside the text
    logit_bias: dict[str, float] | None = None  # JSON keys: token ids as text

    def params(self) -> dict[str, Any]:
        """The SamplingParams fields the body sets (None: the server default)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        out: dict[str, Any] = {
            name: getattr(self, name)
            for name in ("seed", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                         "frequency_penalty", "repetition_penalty", "skip_special_tokens")
        }
        if self.logit_bias:
            try:
                out["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
            except ValueError:
                raise HTTPError(400, "logit_bias keys must be token ids", "logit_bias") from None
        out |= {"stop": stop or [], "stop_token_ids": self.stop_token_ids or [],
                "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos, "priority": self.priority}
        if self.response_format is not None and self.response_format.type == "json_object":
            out["json_object"] = True
        elif self.response_format is not None and self.response_format.type == "json_schema":
            schema = (self.response_format.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise HTTPError(400, "response_format.json_schema.schema must be a JSON schema object",
                                "response_format")
            out["json_schema"] = json.dumps(schema)  # as gRPC clients send it: one grammar cache key
        if self.structured_outputs is not None:
            if self.response_format is not None and self.response_format.type != "text":
                raise HTTPError(400, "structured_outputs and response_format cannot both constrain the "
                                     "output", "structured_outputs")
            out |= self.structured_outputs.params()
        return out

    def check_supported(self) -> None:
        """A 400 naming the first field the server would otherwise ignore though it changes the result."""
        name = first_refused(self.model_extra, self.REFUSED)
        if name is not None:
            raise HTTPError(400, f"{name} is not supported by this server", name, "unsupported_parameter")


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, le=MAX_TOKEN_ID)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOKEN_ID)


class ChatMessageBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept only to refuse what would not reach the template

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # accepted; the chat template is given role, content and tool calls
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def check_supported(self) -> None:
        name = first_refused(self.model_extra, MESSAGE_REFUSED)
        if name is not None:
            raise HTTPError(400, f"messages: {name} is not supported by this server", "messages",
                            "unsupported_parameter")

    def text(self) -> str:
        """The content as text (OpenAI's list of parts: its text parts, concatenated)."""
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise HTTPError(400, "messages: only text content parts are supported", "messages")
            return "".join(str(part.get("text", "")) for part in self.content)
        return self.content or ""

    def message(self) -> ChatMessage:
        """As the tokenizer renders it: calls checked to be OpenAI's function calls."""
        for call in self.tool_calls or ():
            function = call.get("function")
            if call.get("type", "function") != "function" or not isinstance(function, dict) or not (
                    isinstance(function.get("name"), str) and isinstance(function.get("arguments", ""), str)):
                raise HTTPError(400, "messages: tool_calls must be function calls {\"id\", \"type\": "
                                     '"function", "function": {"name", "arguments": JSON text}}', "messages")
        return ChatMessage(self.role, self.text(), self.tool_calls or None, self.tool_call_id)


class ChatRequest(Sampling):
    REFUSED: ClassVar[dict[str, Rule]] = CHAT_REFUSED

    messages: list[ChatMessageBody]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_ID)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_ID)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOKEN_ID)

    def check_supported(self) -> None:
        super().check_supported()
        for message in self.messages:
            message.check_supported()


class LoadLoRABody(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRABody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's body may carry it: the name decides


class TokenizeBody(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = None
    tools: list[dict[str, Any]] | None = None  # with messages: rendered by the chat template, as on chat
    add_special_tokens: bool = True


class DetokenizeBody(BaseModel):
    model: str | None = None
    tokens: list[int]


# ---- responses ----------------------------------------------------------------------------------


@dataclass
class Choice:
    """What one engine request (one choice) returned so far."""

    index: int
    stream: Stream
    text: list[str] = field(default_factory=list)
    logprobs: Logprobs = field(default_factory=Logprobs)  # rendered by the detokenizer
    prompt_logprobs: Logprobs | None = None
    emitted: int = 0  # characters sent so far (text_offset)
    sent: bool = False  # a stream event of it went out
    ids: list[int] = field(default_factory=list)  # with return_token_ids
    tools: ToolOutput | None = None  # chat with tools: its text read as tool calls
    reasoning: ReasoningParser | None = None  # --reasoning-parser: chat text split into reasoning first

    def add(self, rows: list[Delta], logprobs: bool = True) -> None:
        """The rows' output kept for the response; logprobs False: not their logprobs (a stream
        sends them as they come and never reads them again)."""
        for row in rows:
            self.text.append(row.text)
            if logprobs:
                self.logprobs.add(row.logprobs_json)
            self.ids += row.ids.tolist()
            if row.prompt_logprobs_json is not None:
                self.prompt_logprobs = Logprobs([row.prompt_logprobs_json])


Output = tuple[Choice, list[Delta], bool]  # a choice, its new rows, whether they end it


def usage(choices: list[Choice], per_prompt: int, generated: bool = True) -> dict[str, Any]:
    """OpenAI usage over every choice; the n choices of a prompt count its tokens once. generated
    False: the output was not returned (max_tokens 0 with echo)."""
    prompt = sum(c.stream.prompt_tokens for c in choices[::per_prompt])
    cached = sum(c.stream.cached_prompt_tokens for c in choices[::per_prompt])
    completion = sum(c.stream.completion_tokens for c in choices) if generated else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _json(payload: dict[str, Any]) -> bytes:
    return dumps(payload).encode()


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload).encode() + b"\n\n"


# ---- the app ------------------------------------------------------------------------------------


@dataclass
class Call:
    """One HTTP generation call: its kind, its choices, and how to render them."""

    chat: bool
    model: str
    choices: list[Choice]
    per_prompt: int
    logprobs: bool
    prompts: list[str] = field(default_factory=list)  # echo: each prompt's text, else empty
    generated: bool = True  # False: max_tokens 0 with echo, the engine's one token is not returned
    return_token_ids: bool = False  # vLLM's extension: each choice's token ids beside its text
    rid: str = ""
    tools: ToolPlan | None = None  # chat with tools
    reasoning: type[ReasoningParser] | None = None  # chat under --reasoning-parser
    created: int = field(default_factory=lambda: int(time.time()))
    _chunk_head: str = field(default="", init=False, repr=False)  # chunk_event's, written once

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def head(self, chunk: bool) -> dict[str, Any]:
        return {"id": self.rid, "object": self.kind + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.model}

    def chunk_event(self, choice: dict[str, Any]) -> bytes:
        """sse(head(True) | {"choices": [choice]}), byte for byte, with the head written once per call
        rather than once per event of each choice."""
        if not self._chunk_head:
            self._chunk_head = dumps(self.head(True))[:-1] + ',"choices":['
        return b"data: " + (self._chunk_head + dumps(choice) + "]}").encode() + b"\n\n"

    def choice(self, c: Choice, text: str, entries: Logprobs, finish: str | None, first: bool,
               chunk: bool, ids: list[int]) -> dict[str, Any]:
        """One choice of a response (chunk: of a stream event); first: its first; ids: its tokens."""
        out: dict[str, Any] = {"index": c.index}
        if self.return_token_ids:
            out["token_ids"] = ids if self.generated else []
        if self.chat:
            if chunk:
                out["delta"] = ({"role": "assistant"} if first else {}) | {"content": text}
            else:
                message: dict[str, Any] = {"role": "assistant"}
                answer = read_answer(text, finish or "", c.tools, c.reasoning)
                if c.reasoning is not None:
                    message["reasoning"] = answer.reasoning
                    message["reasoning_content"] = answer.reasoning  # the older name, still read
                if c.tools is not None:
                    message["tool_calls"] = [call.message() for call in answer.calls]
                    finish = answer.finish
                out["message"] = message | {"content": answer.content}
            out["logprobs"] = entries.chat() if self.logprobs else None
        else:
            if not self.generated:
                text, entries = "", Logprobs()
            if first and self.prompts:
                text = self.prompts[c.index // self.per_prompt] + text
                entries = (c.prompt_logprobs or Logprobs()) + entries
            out["text"] = text
            out["logprobs"] = entries.completion(c.emitted) if self.logprobs else None
            c.emitted += len(text)
        out["finish_reason"] = finish or None
        return out

    def chat_chunks(self, c: Choice, text: str, entries: Logprobs, finish: str | None,
                    first: bool, ids: list[int]) -> list[dict[str, Any]]:
        """The stream chunks of new text of a chat choice split into reasoning and/or read as tool
        calls: its reasoning, its content, then each call's delta (the first of a call: index, id,
        type, name; then argument fragments) in a chunk of its own; the last chunk carries the
        finish. Empty when there is nothing to send."""
        last = finish is not None
        reasoning = ""
        if c.reasoning is not None:
            split = c.reasoning.feed(text, last)
            reasoning, text = split.reasoning, split.content
        calls: list[dict[str, Any]] = []
        if c.tools is not None:
            piece = c.tools.feed(text, last)
            text, calls = piece.content, piece.calls
            finish = c.tools.finish(finish) if finish else None
        if not reasoning and not text and not calls and not first and not finish and not entries and not ids:
            return []
        deltas: list[dict[str, Any]] = []
        if reasoning:
            deltas.append({"reasoning": reasoning, "reasoning_content": reasoning})
        if text or not (deltas or calls):
            deltas.append({"content": text})
        deltas += [{"tool_calls": [call]} for call in calls]
        out = []
        for i, delta in enumerate(deltas):
            choice = self.choice(c, "", entries if i == 0 else Logprobs(),
                                 finish if i == len(deltas) - 1 else None, first and i == 0, True,
                                 ids if i == 0 else [])
            choice["delta"] = ({"role": "assistant"} if first and i == 0 else {}) | delta
            out.append(self.head(True) | {"choices": [choice]})
        return out

    def final(self) -> dict[str, Any]:
        choices = [self.choice(c, "".join(c.text), c.logprobs, c.stream.finish, True, False, c.ids)
                   for c in self.choices]
        return self.head(False) | {"choices": choices,
                                   "usage": usage(self.choices, self.per_prompt, self.generated)}


class OpenAIServer:
    """The HTTP front end of one gateway core."""

    def __init__(self, core: Core, config: GatewayConfig, tokenizer: EngineConfig | None = None) -> None:
        self.core, self.config = core, config
        self.tokenizer_config = tokenizer  # what /tokenize and /detokenize load, on first use
        self._tokenizer: Any = None
        self.responses = Responses(core, config, self._model_or_adapter)
        self.embeddings = Embeddings(core, self._model)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0
        self.app = self._build()

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self, host: str, port: int) -> int:
        """Listen (the port owned, as gRPC's: no SO_REUSEPORT) and serve on the running loop."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        sock.listen(2048)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        refused = self.core.metrics.http_refused
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                **uvicorn_options(self.config, lambda reason: refused.labels(reason).inc()))
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)

    # ---- routes ---------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI(title="pipeserve", docs_url=None, redoc_url=None, openapi_url=None)
        if self.config.allowed_origins:  # --allowed-origins: without it no browser page may call the API
            origins = [o.strip() for o in self.config.allowed_origins.split(",") if o.strip()]
            app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                               allow_headers=["Authorization", "Content-Type"])

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            return invalid_body(list(exc.errors())).response()

        @app.exception_handler(HTTPError)
        async def refused(request: Request, exc: HTTPError) -> JSONResponse:
            return exc.response()

        @app.exception_handler(StarletteHTTPException)
        async def routing(request: Request, exc: StarletteHTTPException) -> Response:
            """An unknown path (404) or a wrong method (405), in OpenAI's error shape."""
            error = HTTPError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                              code=ROUTING_CODES.get(exc.status_code))
            response = error.response()
            response.headers.update(exc.headers or {})  # 405: Allow
            return response

        # --api-key guards the API; probes and metrics carry no secrets (as vLLM). The two generation
        # routes are plain Starlette routes (key checked inline, body parsed straight from its
        # bytes): FastAPI's dependency solving and body machinery cost each request time on the
        # gateway's loop, before anything reaches the pipeline.
        app.add_route("/v1/completions", self._parsed(CompletionRequest, self.completions, "prompt"),
                      ["POST"])
        app.add_route("/v1/chat/completions", self._parsed(ChatRequest, self.chat, "messages"), ["POST"])
        app.add_route("/v1/responses", self._parsed(ResponsesRequest, self.responses.create, "input"),
                      ["POST"])
        app.add_route("/v1/embeddings", self._parsed(EmbeddingRequest, self.embeddings.create, "input"),
                      ["POST"])
        keyed = [Depends(self._check_key), Depends(_json_body)]
        app.get("/v1/models", dependencies=keyed)(self.models)
        app.post("/v1/load_lora_adapter", dependencies=keyed)(self.load_lora_adapter)
        app.post("/v1/unload_lora_adapter", dependencies=keyed)(self.unload_lora_adapter)
        app.post("/tokenize", dependencies=keyed)(self.tokenize)
        app.post("/detokenize", dependencies=keyed)(self.detokenize)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics)
        app.get("/version")(self.version)
        return app

    def _parsed(self, model: type[B], handler: Callable[[B, Request], Awaitable[Response]], input: str
                ) -> Callable[[Request], Awaitable[Response]]:
        """A route calling handler with the request's body validated as model (400s as FastAPI's);
        input names the field an oversized body is blamed on. A client that leaves while its body is
        read or its answer computed gets nothing (it is gone): one debug line, no traceback."""

        async def endpoint(request: Request) -> Response:
            self._authorize(request)
            _check_json(request)
            try:
                data = await request.body()
            except ClientDisconnect:
                log.debug("%s: the client disconnected while sending its body", request.url.path)
                return Response(status_code=CLIENT_CLOSED)
            limit = self.config.max_request_bytes
            if len(data) > limit:
                raise self._refused(HTTPError(400, f"{input} is too large: the request is {len(data)} "
                                                   f"bytes, at most {limit} allowed", input))
            try:
                body = model.model_validate_json(data)
            except ValidationError as exc:
                raise invalid_body(exc.errors()) from None
            body.check_supported()
            try:
                return await handler(body, request)
            except Disconnected:
                log.debug("%s: the client disconnected before its answer", request.url.path)
                return Response(status_code=CLIENT_CLOSED)

        return endpoint

    def _refused(self, error: HTTPError) -> HTTPError:
        """Count a refusal decided here, before the core saw the request."""
        self.core.refused(Refusal(ErrorCode.INVALID_ARGUMENT, error.message))
        return error

    async def _check_key(self, request: Request) -> None:  # async: FastAPI runs sync ones on threads
        self._authorize(request)

    def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        given = request.headers.get("authorization", "")
        if key and not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise HTTPError(401, "missing or wrong API key (Authorization: Bearer KEY, --api-key)",
                            code="invalid_api_key", kind="authentication_error")

    async def health(self) -> Response:
        return Response(status_code=200 if self.core.serving else 503)

    async def metrics(self) -> Response:
        return Response(self.core.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def version(self) -> dict[str, str]:
        try:
            return {"version": version("pipeserve")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    async def models(self) -> dict[str, Any]:
        info = self.core.model_info()
        if info is None:
            return {"object": "list", "data": []}
        model = {"id": info.name, "object": "model", "created": 0, "owned_by": "pipeserve",
                 "max_model_len": info.context_length, "root": info.name, "parent": None}
        adapters = [{"id": name, "object": "model", "created": 0, "owned_by": "pipeserve",
                     "max_model_len": info.context_length, "root": request.lora_path, "parent": info.name}
                    for name, request in self.core.adapters.by_name.items()]
        return {"object": "list", "data": [model, *adapters]}

    # ---- LoRA adapters (--allow-runtime-lora) -------------------------------------------------------
    def _runtime_lora(self) -> None:
        if not self.core.adapters.runtime:
            raise HTTPError(403, "loading and unloading LoRA adapters is off: start the server with "
                                 "--enable-lora --allow-runtime-lora", code="lora_runtime_disabled",
                            kind="permission_error")

    async def load_lora_adapter(self, body: LoadLoRABody) -> Response:
        """Validate the adapter's directory now (a 400 naming the file, or saying "rank"), then serve it
        under lora_name."""
        self._runtime_lora()
        try:
            # Reads two small files: off the loop.
            await asyncio.to_thread(self.core.adapters.load, body.lora_name, body.lora_path)
        except LoRAError as exc:
            raise HTTPError(400, str(exc), "lora_path" if "lora_name" not in str(exc) else "lora_name",
                            "invalid_lora_adapter") from None
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                        media_type="text/plain")

    async def unload_lora_adapter(self, body: UnloadLoRABody) -> Response:
        """Requests already admitted finish with it; new ones naming it are a 404."""
        self._runtime_lora()
        if not self.core.adapters.unload(body.lora_name):
            raise HTTPError(404, f"the LoRA adapter {body.lora_name!r} is not loaded", "lora_name",
                            "model_not_found")
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                        media_type="text/plain")

    def _model_or_adapter(self, requested: str | None) -> tuple[str, str]:
        """(the model a response names, the LoRA adapter it runs: "" for the base model): the model
        field names the base model or one of the adapters."""
        if requested and self.core.adapters.get(requested) is not None:
            self._model(None)  # 503 before the engine reports
            return requested, requested
        return self._model(requested), ""

    def _model(self, requested: str | None) -> str:
        info = self.core.model_info()
        if info is None:
            raise HTTPError(503, "not serving: the engine has not reported yet", kind="server_error")
        if requested and requested != info.name:
            raise HTTPError(404, f"the model {requested!r} does not exist; this server serves {info.name!r}",
                            "model", "model_not_found")
        return info.name

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        model, lora = self._model_or_adapter(body.model)
        prompts = self._prompts(body.prompt)
        if body.max_tokens == 0 and not body.echo:
            raise HTTPError(400, "max_tokens must be >= 1 (0 only with echo)", "max_tokens")
        # max_tokens 0 (echo: score the prompt only, as lm-evaluation-harness does): the engine
        # still samples one token, which is not returned.
        given = body.params() | {"max_tokens": body.max_tokens or 1, "logprobs": body.logprobs}
        if body.echo and body.logprobs is not None:
            given["prompt_logprobs"] = body.logprobs
        call = Call(False, model, [], body.n, body.logprobs is not None, rid=f"cmpl-{uuid.uuid4().hex}",
                    generated=body.max_tokens != 0, return_token_ids=body.return_token_ids)
        if body.echo:
            call.prompts = [p if isinstance(p, str) else await self._decode(p) for p in prompts]
        inputs: list[Prompt] = [p if isinstance(p, str) else np.asarray(p, dtype=np.int64) for p in prompts]
        return await self._serve(call, inputs, given, body, request, lora=lora)

    async def chat(self, body: ChatRequest, request: Request) -> Response:
        model, lora = self._model_or_adapter(body.model)
        if not body.messages:
            raise HTTPError(400, "messages must not be empty", "messages")
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise HTTPError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            most = self.core.model_info().max_logprobs  # type: ignore[union-attr]  # _model checked it
            if body.top_logprobs > most:
                raise HTTPError(400, f"top_logprobs must be at most {most} (--max-logprobs), got "
                                     f"{body.top_logprobs}", "top_logprobs")
        messages = [m.message() for m in body.messages]
        max_tokens = body.max_completion_tokens or body.max_tokens
        given = body.params() | {"max_tokens": max_tokens,
                                 "logprobs": (body.top_logprobs or 0) if body.logprobs else None}
        reasoning = self.config.reasoning_parser
        try:
            plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.config)
            given = chat_sampling(given, plan, reasoning)
        except ValueError as exc:
            param = PARAM.match(str(exc))
            raise HTTPError(400, str(exc), param.group(1) if param else "tools") from None
        call = Call(True, model, [], body.n, body.logprobs, rid=f"chatcmpl-{uuid.uuid4().hex}",
                    return_token_ids=body.return_token_ids, tools=plan,
                    reasoning=REASONING_PARSERS[reasoning] if reasoning else None)
        return await self._serve(call, [messages], given, body, request, fit_max_tokens=max_tokens is None,
                                 lora=lora)

    @staticmethod
    def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise HTTPError(400, "prompt must not be empty", "prompt")
        prompts: list[Any] = [prompt] if isinstance(prompt[0], int) else list(prompt)
        for p in prompts:
            if not isinstance(p, str) and any(not 0 <= i <= MAX_TOKEN_ID for i in p):
                raise HTTPError(400, f"prompt has token ids outside [0, {MAX_TOKEN_ID}]", "prompt")
        return prompts

    async def _serve(self, call: Call, prompts: list[Prompt], given: dict[str, Any], body: Sampling,
                     request: Request, fit_max_tokens: bool = False, lora: str = "") -> Response:
        """Submit every prompt's n engine requests, then answer as one JSON body or as a stream. A
        stream's response starts with its first output: what fails before it is an HTTP error.
        lora: the LoRA adapter they run ("": the base model)."""
        try:
            params = self.core.sampling(given, fit_max_tokens)
            for p, prompt in enumerate(prompts):
                streams = await self.core.submit(params, prompt, f"{call.rid}-{p}", n=body.n,
                                                 cache_salt=body.cache_salt, fit_max_tokens=fit_max_tokens,
                                                 tools=call.tools.tools if call.tools else None,
                                                 logprobs_format="chat" if call.chat else "completion",
                                                 lora=lora)
                call.choices += [Choice(p * body.n + i, s, tools=call.tools.output() if call.tools else None,
                                        reasoning=call.reasoning() if call.reasoning else None)
                                 for i, s in enumerate(streams)]
        except Refusal as refusal:
            self._close(call)
            raise from_refusal(refusal) from None
        if body.stream:
            merged = self._merged(call)
            try:
                first = await until_disconnect(request, anext(merged))
            except Refusal as refusal:
                self._close(call)
                raise from_refusal(refusal) from None
            except BaseException:
                self._close(call)
                raise
            usage_last = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self._events(call, first, merged, usage_last),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            result = await until_disconnect(request, self._collect(call))
            if not call.logprobs:
                return JSONResponse(result)
            # Logprob tables can be megabytes of JSON: encoded off the loop (see _events).
            return Response(await asyncio.to_thread(_json, result), media_type="application/json")
        except Refusal as refusal:
            raise from_refusal(refusal) from None
        finally:
            self._close(call)

    def _close(self, call: Call) -> None:
        for c in call.choices:
            self.core.close(c.stream)

    async def _collect(self, call: Call) -> dict[str, Any]:
        async def one(c: Choice) -> None:
            async for rows, _ in self.core.output(c.stream):
                c.add(rows)

        await asyncio.gather(*(one(c) for c in call.choices))
        return await asyncio.to_thread(call.final) if call.logprobs else call.final()

    async def _events(self, call: Call, first: list[Output], rest: AsyncGenerator[list[Output], None],
                      usage_last: bool) -> AsyncIterator[bytes]:
        """The SSE stream of a call: chunks as each choice's output arrives (first: what already
        came), then [DONE]; the events of every choice's output that arrived together go out in one
        write. Leaving early (a disconnect cancels this generator) closes every stream: the engine
        aborts them."""
        try:
            async for batch in _chain(first, rest):
                events = [event for c, rows, last in batch if (event := self._event(call, c, rows, last))]
                if events:
                    yield b"".join(events)
            if usage_last:
                totals = usage(call.choices, call.per_prompt, call.generated)
                yield sse(call.head(True) | {"choices": [], "usage": totals})
        except Refusal as refusal:
            yield sse(from_refusal(refusal).body())
        finally:
            self._close(call)
            await rest.aclose()  # now, not when collected: it cancels the choices' pumps
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _event(call: Call, c: Choice, rows: list[Delta], last: bool) -> bytes:
        """The SSE event(s) of a choice's new rows; empty when there is nothing to send yet."""
        text = "".join(r.text for r in rows)
        entries = Logprobs(r.logprobs_json for r in rows)
        ids = [int(i) for r in rows for i in r.ids] if call.return_token_ids else []
        first_of_choice = not c.sent
        c.add(rows, logprobs=False)
        if not text and not entries and not ids and not last and not first_of_choice:
            return b""  # nothing a client reads (e.g. text held back by the detokenizer)
        if first_of_choice and not call.generated and not last:
            return b""  # max_tokens 0: the prompt goes out with the finish

        # Logprob tables (top-k per token, n choices) came rendered from the detokenizer: the
        # loop only joins them, so no request delays another's tokens, health or metrics.
        c.sent = True
        finish = c.stream.finish if last else None
        if c.tools is not None or c.reasoning is not None:
            return b"".join(sse(chunk) for chunk in
                            call.chat_chunks(c, text, entries, finish, first_of_choice, ids))
        choice = call.choice(c, text, entries, finish, first_of_choice, True, ids)
        return call.chunk_event(choice)

    async def _merged(self, call: Call) -> AsyncGenerator[list[Output], None]:
        """Every choice's output in arrival order, in batches of what arrived together (one choice:
        read directly, no tasks)."""
        if len(call.choices) == 1:
            (c,) = call.choices
            async for rows, last in self.core.output(c.stream):
                yield [(c, rows, last)]
            return
        queue: asyncio.Queue[tuple[Choice, list[Delta], bool] | Refusal | None] = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                async for rows, last in self.core.output(c.stream):
                    queue.put_nowait((c, rows, last))
            except Refusal as refusal:
                queue.put_nowait(refusal)
            queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(c)) for c in call.choices]
        try:
            remaining = len(tasks)
            while remaining:
                batch: list[Output] = []
                item = await queue.get()
                while True:
                    if item is None:
                        remaining -= 1
                    elif isinstance(item, Refusal):
                        if batch:
                            yield batch  # what came before the failure goes out first
                        raise item
                    else:
                        batch.append(item)
                    if queue.empty() or not remaining:
                        break
                    item = queue.get_nowait()
                if batch:
                    yield batch
        finally:
            for task in tasks:
                task.cancel()

    # ---- tokenizer endpoints -------------------------------------------------------------------
    async def tokenize(self, body: TokenizeBody) -> dict[str, Any]:
        self._model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "prompt or messages: give exactly one", "prompt")
        tokenizer = await self._load_tokenizer()
        chat = [m.message() for m in body.messages or []]

        def encode() -> list[int]:
            if body.prompt is not None:
                ids: list[int] = tokenizer.tokenizer.encode(body.prompt,
                                                            add_special_tokens=body.add_special_tokens)
                return ids
            chat_ids: list[int] = tokenizer.encode_messages(chat, body.tools)
            return chat_ids

        try:
            ids = await asyncio.to_thread(encode)
        except ValueError as exc:
            raise HTTPError(400, str(exc), "messages") from None
        return {"count": len(ids), "max_model_len": tokenizer.max_model_len, "tokens": ids}

    async def detokenize(self, body: DetokenizeBody) -> dict[str, Any]:
        self._model(body.model)
        tokenizer = await self._load_tokenizer()
        ids = np.asarray(body.tokens, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
            raise HTTPError(400, f"tokens: ids must be in [0, {tokenizer.vocab_size})", "tokens")
        return {"prompt": await self._decode(body.tokens)}

    async def _decode(self, ids: list[int]) -> str:
        tokenizer = await self._load_tokenizer()
        text: str = await asyncio.to_thread(tokenizer.tokenizer.decode, ids)
        return text

    async def _load_tokenizer(self) -> Any:
        return await asyncio.to_thread(self._tokenizer_once)

    def _tokenizer_once(self) -> Any:
        """The served tokenizer as a tokenizer worker holds it (loaded once, on a worker thread)."""
        if self._tokenizer is None:
            from pipeserve.tokenizer.load import load_for  # transformers: only when first asked
            from pipeserve.tokenizer.worker import Tokenizer

            config = self.tokenizer_config or EngineConfig(model=os.environ.get("PIPESERVE_MODEL"))
            tokenizer = load_for(config)[1]
            info = self.core.model_info()
            context = info.context_length if info else tokenizer.model_max_length
            self._tokenizer = Tokenizer(tokenizer, context, info.vocab_size if info else None)
        return self._tokenizer


async def _chain(first: list[Output], rest: AsyncIterator[list[Output]]) -> AsyncIterator[list[Output]]:
    yield first
    async for item in rest:
        yield item


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the gateway owns SIGINT/SIGTERM and stops it in order."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _check_json(request: Request) -> None:
    """A body must say it is JSON (415 otherwise): a browser sends text/plain and form bodies from
    any page without asking the server first (CORS "simple requests"), JSON only after a preflight."""
    if request.method != "POST":
        return
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        raise HTTPError(415, f"Content-Type must be application/json, got {kind or 'none'!r}",
                        code="unsupported_media_type")


async def _json_body(request: Request) -> None:  # async: FastAPI runs sync dependencies on threads
    _check_json(request)
