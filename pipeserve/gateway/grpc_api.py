"""The gRPC front end (`Generation` service, standard health, reflection): grpc.aio on the gateway's
loop, a thin layer over the core (gateway/requests.py). A GenerateRequest becomes SamplingParams and
a Prompt; the core's neutral refusals become gRPC status codes of the same names.

It owns its port (SO_REUSEPORT off: a second server on the port fails to start instead of sharing
its calls), and its health service answers for one more service name, the gateway's instance id:
a readiness check for that name can only be answered SERVING by this very process.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pipeserve.config import GatewayConfig
from pipeserve.gateway.embeddings import embed
from pipeserve.gateway.pb import generation_pb2 as pb
from pipeserve.gateway.pb import generation_pb2_grpc as pb_grpc
from pipeserve.gateway.reasoning import PARSERS as REASONING_PARSERS
from pipeserve.gateway.reasoning import ReasoningParser
from pipeserve.gateway.requests import Core, Delta, ErrorCode, Prompt, Refusal, Stream, invalid
from pipeserve.gateway.tool_calls import ToolOutput, chat_sampling, plan_tools, read_answer
from pipeserve.messages import ChatMessage, TokenLogprob
from pipeserve.sampling_params import CONSTRAINTS

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# proto3 `optional` fields: unset means the server's default.
OPTIONAL_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "speculative",
)


def status(code: ErrorCode) -> grpc.StatusCode:
    """The gRPC status of a neutral code (they share names)."""
    return grpc.StatusCode[code.name]


def sampling_fields(request: pb.GenerateRequest) -> dict[str, Any]:
    """The sampling fields the request set (SamplingParams names; unset optional fields left out)."""
    given: dict[str, Any] = {name: getattr(request, name) for name in OPTIONAL_SAMPLING
                             if request.HasField(name)}
    constraint = request.WhichOneof("constraint")
    if constraint == "choice":
        given["choice"] = list(request.choice.choices)
    elif constraint is not None:
        assert constraint in CONSTRAINTS
        given[constraint] = getattr(request, constraint)
    given |= {"stop": list(request.stop), "stop_token_ids": list(request.stop_token_ids),
              "ignore_eos": request.ignore_eos, "min_tokens": request.min_tokens,
              "priority": request.priority}
    if request.logit_bias:
        given["logit_bias"] = dict(request.logit_bias)
    return given


def prompt_of(request: pb.GenerateRequest) -> Prompt:
    which = request.WhichOneof("input")
    if which is None:
        raise invalid("prompt is missing: set one of prompt, prompt_token_ids or messages")
    if which == "prompt":
        return request.prompt
    if which == "prompt_token_ids":
        return np.asarray(request.prompt_token_ids.ids, dtype=np.int64)
    return [ChatMessage(m.role, m.content, [_call(c) for c in m.tool_calls] or None, m.tool_call_id or None)
            for m in request.messages.messages]


def _call(call: pb.ToolCall) -> dict[str, Any]:
    """A history message's call as OpenAI's (what the chat template is given)."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tools_of(request: pb.GenerateRequest) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any] | None]:
    """The request's tools as OpenAI function tools and its tool_choice as OpenAI's (None: unset)."""
    tools = []
    for i, tool in enumerate(request.tools):
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            try:
                function["parameters"] = json.loads(tool.parameters)
            except json.JSONDecodeError as exc:
                raise invalid(f"tools[{i}].parameters is not JSON: {exc}") from None
        if tool.strict:
            function["strict"] = True
        tools.append({"type": "function", "function": function})
    which = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    choice: str | dict[str, Any] | None = None
    if which == "mode":
        choice = request.tool_choice.mode
    elif which == "function":
        choice = {"type": "function", "function": {"name": request.tool_choice.function}}
    return tools or None, choice


@dataclass
class ChatReading:
    """How the last response of a messages request reads its whole text: calls (with tools) and the
    reasoning split (under --reasoning-parser), as the HTTP API's chat message."""

    tools: ToolOutput | None
    reasoning: ReasoningParser | None
    text: list[str] = field(default_factory=list)

    def fill(self, out: pb.GenerateResponse) -> None:
        answer = read_answer("".join(self.text), out.finish_reason, self.tools, self.reasoning)
        if answer.reasoning is not None:
            out.reasoning = answer.reasoning
        if answer.content is not None:
            out.content = answer.content
        for call in answer.calls:
            out.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
        out.finish_reason = answer.finish


def response(stream: Stream, rows: list[Delta], last: bool) -> pb.GenerateResponse:
    """Rows taken by Stream.take_rows() as one GenerateResponse (the last one with finish and usage)."""
    out = pb.GenerateResponse(request_id=stream.rid, text="".join(r.text for r in rows))
    if rows:
        out.token_ids.extend(np.concatenate([r.ids for r in rows]).tolist())
    for row in rows:
        if row.logprobs:
            out.logprobs.extend(token_logprobs(row.logprobs))
        if row.prompt_logprobs:
            out.prompt_logprobs.extend(token_logprobs(row.prompt_logprobs))
    if last:
        out.finish_reason = stream.finish
        out.usage.prompt_tokens = stream.prompt_tokens
        out.usage.completion_tokens = stream.completion_tokens
        out.usage.cached_prompt_tokens = stream.cached_prompt_tokens
    return out


def token_logprobs(entries: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    """The detokenizer's per-token logprobs as protobuf."""
    return [
        pb.TokenLogprob(
            token_id=e.token_id,
            token=e.token,
            logprob=e.logprob,
            top=[pb.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob) for t in e.top],
        )
        for e in entries
    ]


def parse_request(data: bytes) -> pb.GenerateRequest | DecodeError:
    """GenerateRequest.FromString that returns the error instead of raising it (see GrpcFrontEnd.start)."""
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as exc:
        return exc


class GrpcFrontEnd(pb_grpc.GenerationServicer):
    def __init__(self, core: Core, config: GatewayConfig, instance_id: str) -> None:
        self.core, self.config, self.instance_id = core, config, instance_id
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        core.on_serving.append(self._set_health)

    async def start(self) -> int:
        """Listen on config.host:port; the port, or 0 when it could not be had."""
        limit = self.config.max_request_bytes
        server = grpc.aio.server(
            interceptors=[BearerToken(self.config.api_key)] if self.config.api_key else [],
            options=[
                ("grpc.max_receive_message_length", 4 * limit),  # so oversize gets our INVALID_ARGUMENT
                ("grpc.max_send_message_length", 4 * self.config.max_response_bytes),
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.keepalive_timeout_ms", 10_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.so_reuseport", 0),  # see the module docstring: one server per port
            ]
        )
        handlers = {
            # Parsed by us, so that bytes that are no GenerateRequest (bad UTF-8 in a string field,
            # corrupt wire data) get INVALID_ARGUMENT rather than grpc's UNKNOWN.
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate, parse_request, pb.GenerateResponse.SerializeToString
            ),
            "Abort": grpc.unary_unary_rpc_method_handler(
                self.Abort, pb.AbortRequest.FromString, pb.AbortResponse.SerializeToString
            ),
            "ModelInfo": grpc.unary_unary_rpc_method_handler(
                self.ModelInfo, pb.ModelInfoRequest.FromString, pb.ModelInfoResponse.SerializeToString
            ),
            "Embed": grpc.unary_unary_rpc_method_handler(
                self.Embed, pb.EmbedRequest.FromString, pb.EmbedResponse.SerializeToString
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{self.config.host}:{self.config.port}"
        port: int
        try:
            if self.config.tls_cert and self.config.tls_key:
                with open(self.config.tls_key, "rb") as key, open(self.config.tls_cert, "rb") as cert:
                    credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
                port = server.add_secure_port(address, credentials)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError:  # grpc versions differ: some raise, some return port 0
            port = 0
        if port:
            await self._set_health(False)
            await server.start()
            self._server = server
        return port

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)

    async def _set_health(self, serving: bool) -> None:
        states = health_pb2.HealthCheckResponse
        code = states.SERVING if serving else states.NOT_SERVING
        for service in ("", SERVICE, self.instance_id):
            await self.health.set(service, code)

    # ---- RPCs ------------------------------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest | DecodeError, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if isinstance(request, DecodeError):
            self.core.refused(invalid(""))
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is not a valid GenerateRequest ({request}); string fields such as prompt, "
                "stop and messages must be valid UTF-8",
            )
            return
        try:
            stream, reading = await self._submit(request)
        except Refusal as refusal:
            await context.abort(status(refusal.code), refusal.message)
        # Both paths: grpc.aio does not always raise CancelledError into the handler on a cancel.
        context.add_done_callback(lambda _: self.core.close(stream))
        try:
            async for rows, last in self.core.output(stream):
                # Logprob tables become protobuf off the loop (see openai_api's events).
                if any(r.logprobs or r.prompt_logprobs for r in rows):
                    out = await asyncio.to_thread(response, stream, rows, last)
                else:
                    out = response(stream, rows, last)
                if reading is not None:
                    reading.text.append(out.text)
                    if last:
                        reading.fill(out)
                yield out
        except Refusal as refusal:
            await context.abort(status(refusal.code), refusal.message)
        except asyncio.CancelledError:
            self.core.close(stream)
            raise
        finally:
            self.core.close(stream)

    async def _submit(self, request: pb.GenerateRequest) -> tuple[Stream, ChatReading | None]:
        size = request.ByteSize()
        if size > self.config.max_request_bytes:
            which = request.WhichOneof("input") or "request"
            raise self.core.refused(invalid(f"{which} is too large: the request is {size} bytes, at most "
                                            f"{self.config.max_request_bytes} allowed"))
        given = sampling_fields(request)
        plan, reading = None, None
        try:
            prompt = prompt_of(request)
            tools, choice = tools_of(request)
            chat = isinstance(prompt, list)
            if (tools or choice is not None) and not chat:
                raise invalid("tools need a messages input (the chat template renders them)")
            parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
            reasoning = self.config.reasoning_parser if chat else None
            try:
                plan = plan_tools(tools, choice, parallel, self.config)
                given = chat_sampling(given, plan, reasoning)
            except ValueError as exc:
                raise invalid(str(exc)) from None
        except Refusal as refusal:
            raise self.core.refused(refusal) from None
        if plan is not None or reasoning is not None:
            reading = ChatReading(plan.output() if plan is not None else None,
                                  REASONING_PARSERS[reasoning]() if reasoning else None)
        params = self.core.sampling(given)
        (stream,) = await self.core.submit(params, prompt, request.request_id or uuid.uuid4().hex,
                                           app=request.app, cache_salt=request.cache_salt,
                                           tools=plan.tools if plan else None, lora=request.lora)
        return stream, reading

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        size = request.ByteSize()
        if size > self.config.max_request_bytes:
            self.core.refused(invalid(""))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"inputs are too large: the request is "
                                f"{size} bytes, at most {self.config.max_request_bytes} allowed")
        inputs: list[Prompt] = []
        for i, item in enumerate(request.inputs):
            which = item.WhichOneof("input")
            if which is None:
                self.core.refused(invalid(""))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"inputs[{i}]: set text or token_ids")
            inputs.append(item.text if which == "text" else np.asarray(item.token_ids.ids, dtype=np.int64))
        rid = request.request_id or uuid.uuid4().hex
        try:
            results = await embed(self.core, inputs, rid, request.cache_salt)
        except Refusal as refusal:
            await context.abort(status(refusal.code), refusal.message)
        out = pb.EmbedResponse(request_id=rid)
        for result in results:
            out.embeddings.add(values=result.vector.tolist(), prompt_tokens=result.prompt_tokens)
        out.usage.prompt_tokens = sum(r.prompt_tokens for r in results)
        return out

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.core.abort(request.request_id))

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
                        ) -> pb.ModelInfoResponse:
        info = self.core.model_info()
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine has not reported yet")
        fields = pb.ModelInfoResponse.DESCRIPTOR.fields_by_name
        out = pb.ModelInfoResponse(**{k: v for k, v in vars(info).items() if k in fields})
        engines = self.core.router.engines
        out.data_parallel_size = len(engines)
        out.tensor_parallel_size = max(view.tensor_parallel_size for view in engines)
        out.loras.extend(self.core.adapters.names())
        for i, view in enumerate(engines):
            out.engines.add(index=i, serving=view.live, running=view.stats.get("running", 0),
                            waiting=view.stats.get("waiting", 0), routed=view.routed)
        return out


class BearerToken(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """--api-key: every call but the health checks (probes carry no secrets) must send
    "authorization: Bearer <key>", else UNAUTHENTICATED before the handler runs."""

    def __init__(self, key: str) -> None:
        self.expected = f"Bearer {key}".encode()

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(f"/{health.SERVICE_NAME}/"):
            return await continuation(details)
        given = str(dict(details.invocation_metadata or ()).get("authorization", ""))
        handler = await continuation(details)
        if handler is None or hmac.compare_digest(given.encode(), self.expected):
            return handler
        streaming = handler.response_streaming
        deny = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        return deny(_unauthenticated, handler.request_deserializer, handler.response_serializer)


async def _unauthenticated(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (--api-key)")
