"""The pipeserve client: a Python library (sync `Client`, asyncio `AsyncClient`) and the
`pipeserve generate "text"` command, which prints tokens as they stream in.

    with Client("127.0.0.1:50051") as client:
        for chunk in client.stream("Once upon a time", max_tokens=32, temperature=0):
            print(chunk.text, end="", flush=True)
        print(client.generate("Hello", max_tokens=8).text)

A gateway run with --tls-cert/--tls-key and --api-key takes `Client(target, tls_root_cert="cert.pem",
api_key="...")` (tls=True alone trusts the system's roots; tls_server_name overrides the name the
certificate is checked against, e.g. "localhost" when connecting to 127.0.0.1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
import typing
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeserve.gateway.pb import generation_pb2 as pb
from pipeserve.gateway.pb import generation_pb2_grpc as pb_grpc
from pipeserve.sampling_params import CONSTRAINTS, SamplingParams

DEFAULT_TARGET = "127.0.0.1:50051"
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
]
Prompt = str | list[int] | list[dict[str, Any]]
# SamplingParams fields a server sets from its own flags, never a client (--reasoning-parser).
SERVER_SET = ("reasoning_format",)


def build_request(
    prompt: Prompt,
    *,
    request_id: str = "",
    app: str = "",
    cache_salt: str = "",
    params: SamplingParams | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    lora: str = "",
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from text, token ids or chat messages (OpenAI's dicts: role, content, an
    assistant's tool_calls, a tool message's tool_call_id), and sampling keyword arguments (the
    SamplingParams field names; None means the server default). `params` supplies every field.
    tools, tool_choice, parallel_tool_calls: as OpenAI's chat completions (function tools); lora names
    a LoRA adapter."""
    values = params.to_dict() if params is not None else {}
    values.update({k: v for k, v in sampling.items() if v is not None})
    for name in SERVER_SET:
        if values.pop(name, None) is not None:
            raise ValueError(f"{name} is set by the server (--reasoning-parser), not by a request")
    if values.get("logit_bias") is None:
        values.pop("logit_bias", None)
    # The constraint is a oneof: set only the one given (json_object=False would select it too).
    constraint = {name: values.pop(name, None) for name in CONSTRAINTS}
    request = pb.GenerateRequest(request_id=request_id, app=app, cache_salt=cache_salt, lora=lora, **values)
    for name, value in constraint.items():
        if value is None or value is False:
            continue
        if name == "choice":
            request.choice.choices.extend(value)
            request.choice.SetInParent()  # an empty list is still this oneof (and then rejected)
        elif name == "json_schema" and not isinstance(value, str):
            request.json_schema = json.dumps(value)
        else:
            setattr(request, name, value)
    if isinstance(prompt, str):
        request.prompt = prompt
    elif prompt and isinstance(prompt[0], dict):
        for m in prompt:
            message = request.messages.messages.add(role=m["role"], content=m.get("content") or "",
                                                    tool_call_id=m.get("tool_call_id") or "")
            for call in m.get("tool_calls") or ():
                function = call["function"]
                message.tool_calls.add(id=call.get("id", ""), name=function["name"],
                                       arguments=function.get("arguments", ""))
    else:
        request.prompt_token_ids.ids.extend(typing.cast(list[int], prompt))  # dicts took the branch above
        request.prompt_token_ids.SetInParent()  # an empty list is still this oneof (and then rejected)
    for tool in tools or ():
        function = tool["function"]
        parameters = function.get("parameters")
        request.tools.add(name=function["name"], description=function.get("description", ""),
                          parameters="" if parameters is None else json.dumps(parameters),
                          strict=bool(function.get("strict")))
    if isinstance(tool_choice, dict):
        request.tool_choice.function = tool_choice["function"]["name"]
    elif tool_choice is not None:
        request.tool_choice.mode = tool_choice
    if parallel_tool_calls is not None:
        request.parallel_tool_calls = parallel_tool_calls
    return request


@dataclass
class Completion:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    chunks: int = 0  # messages received (fewer than tokens when the server coalesced)
    # A messages request with tools or under --reasoning-parser: the whole output read (last message).
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[pb.ToolCall] = field(default_factory=list)

    def add(self, response: pb.GenerateResponse) -> None:
        self.request_id = response.request_id
        self.text += response.text
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(response.logprobs)
        self.chunks += 1
        if response.finish_reason:
            self.finish_reason = response.finish_reason
            self.prompt_tokens = response.usage.prompt_tokens
            self.completion_tokens = response.usage.completion_tokens
            self.cached_prompt_tokens = response.usage.cached_prompt_tokens
            self.reasoning = response.reasoning if response.HasField("reasoning") else None
            self.content = response.content if response.HasField("content") else None
            self.tool_calls = list(response.tool_calls)


def embed_request(inputs: Sequence[str | Sequence[int]], request_id: str = "",
                  cache_salt: str = "") -> pb.EmbedRequest:
    """An EmbedRequest: each input text or token ids."""
    request = pb.EmbedRequest(request_id=request_id, cache_salt=cache_salt)
    for item in inputs:
        if isinstance(item, str):
            request.inputs.add(text=item)
        else:
            request.inputs.add().token_ids.ids.extend(int(t) for t in item)
    return request


def _health_name(status: int) -> str:
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    return name


@dataclass
class Security:
    """How a client reaches a gateway run with TLS and/or --api-key."""

    tls: bool = False  # TLS with the system's trusted roots (implied by tls_root_cert)
    tls_root_cert: bytes | str | None = None  # PEM bytes, or a path to them (a self-signed cert itself)
    tls_server_name: str | None = None  # the name the certificate must carry, if not the target's host
    api_key: str | None = None  # sent as "authorization: Bearer <key>" on every call

    def channel(self, target: str, aio: bool) -> Any:
        options: list[tuple[str, Any]] = list(CHANNEL_OPTIONS)
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        grpc_ = grpc.aio if aio else grpc
        if not (self.tls or self.tls_root_cert):
            return grpc_.insecure_channel(target, options=options)
        root = self.tls_root_cert
        if isinstance(root, str):
            with open(root, "rb") as f:
                root = f.read()
        return grpc_.secure_channel(target, grpc.ssl_channel_credentials(root), options=options)

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        # Per-call metadata rather than call credentials: gRPC sends those only over TLS, and the
        # gateway accepts a key over plaintext too (e.g. behind a TLS-terminating proxy).
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else None


class Client:
    """Blocking client over one channel; thread-safe (gRPC channels are). Keyword arguments are
    those of Security (TLS and the API key)."""

    def __init__(self, target: str = DEFAULT_TARGET, **security: Any) -> None:
        config = Security(**security)
        self.channel = config.channel(target, aio=False)
        self.metadata = config.metadata()
        self.stub = pb_grpc.GenerationStub(self.channel)  # type: ignore[no-untyped-call]
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def stream(self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any) -> Any:
        """The response stream: iterate it for GenerateResponse chunks; .cancel() aborts the request."""
        return self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout, metadata=self.metadata)

    def generate(self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any) -> Completion:
        completion = Completion()
        for response in self.stream(prompt, timeout=timeout, **kwargs):
            completion.add(response)
        return completion

    def embed(self, inputs: Sequence[str | Sequence[int]], *, timeout: float | None = None,
              **kwargs: Any) -> pb.EmbedResponse:
        """One embedding per input (text or token ids); kwargs: request_id, cache_salt."""
        response: pb.EmbedResponse = self.stub.Embed(embed_request(inputs, **kwargs), timeout=timeout,
                                                     metadata=self.metadata)
        return response

    def abort(self, request_id: str, timeout: float | None = 10.0) -> bool:
        request = pb.AbortRequest(request_id=request_id)
        found: bool = self.stub.Abort(request, timeout=timeout, metadata=self.metadata).found
        return found

    def model_info(self, timeout: float | None = 10.0) -> pb.ModelInfoResponse:
        info: pb.ModelInfoResponse = self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout,
                                                          metadata=self.metadata)
        return info

    def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        """ "SERVING", "NOT_SERVING", ... or "UNREACHABLE"."""
        try:
            return _health_name(
                self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status
            )
        except grpc.RpcError:
            return "UNREACHABLE"

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while (status := self.health()) != "SERVING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not SERVING after {timeout} s (last: {status})")
            time.sleep(0.1)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client over one grpc.aio channel; create it inside the running loop. Keyword
    arguments are those of Security (TLS and the API key)."""

    def __init__(self, target: str = DEFAULT_TARGET, **security: Any) -> None:
        config = Security(**security)
        self.channel = config.channel(target, aio=True)
        self.metadata = config.metadata()
        self.stub = pb_grpc.GenerationStub(self.channel)  # type: ignore[no-untyped-call]
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def stream(self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any) -> Any:
        """The call: `async for` it for chunks; .cancel() aborts the request."""
        return self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout, metadata=self.metadata)

    async def generate(self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any) -> Completion:
        completion = Completion()
        async for response in self.stream(prompt, timeout=timeout, **kwargs):
            completion.add(response)
        return completion

    async def embed(self, inputs: Sequence[str | Sequence[int]], *, timeout: float | None = None,
                    **kwargs: Any) -> pb.EmbedResponse:
        """One embedding per input (text or token ids); kwargs: request_id, cache_salt."""
        response: pb.EmbedResponse = await self.stub.Embed(embed_request(inputs, **kwargs), timeout=timeout,
                                                           metadata=self.metadata)
        return response

    async def abort(self, request_id: str, timeout: float | None = 10.0) -> bool:
        request = pb.AbortRequest(request_id=request_id)
        found: bool = (await self.stub.Abort(request, timeout=timeout, metadata=self.metadata)).found
        return found

    async def model_info(self, timeout: float | None = 10.0) -> pb.ModelInfoResponse:
        info: pb.ModelInfoResponse = await self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout,
                                                                metadata=self.metadata)
        return info

    async def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        try:
            response = await self.health_stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
            return _health_name(response.status)
        except grpc.RpcError:
            return "UNREACHABLE"

    async def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while (status := await self.health()) != "SERVING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not SERVING after {timeout} s (last: {status})")
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ---- `pipeserve generate` -------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text (a user message with --chat)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="gateway host:port")
    parser.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (text, token ids, logprobs, usage, timings) instead "
                             "of streaming the text")
    parser.add_argument("--request-id", default="", help="the request's id; unset: the server assigns one")
    parser.add_argument("--app", default="", help="application label (the output-length predictor learns "
                                                  "per application)")
    parser.add_argument("--cache-salt", default="", help="share prefix-cache pages only with requests that "
                                                         "give the same salt")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    tls = parser.add_argument_group("security (a gateway run with --tls-cert/--tls-key, --api-key)")
    tls.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's roots")
    tls.add_argument("--tls-root-cert", metavar="PEM", help="connect with TLS, trusting this certificate")
    tls.add_argument("--tls-server-name", metavar="NAME", help="the name the server's certificate carries")
    tls.add_argument(
        "--api-key",
        default=os.environ.get("PIPESERVE_API_KEY"),
        help="bearer token (default: $PIPESERVE_API_KEY)",
    )
    sampling = parser.add_argument_group(
        "sampling (unset: the model's generation_config.json default when it has one, else the default shown)"
    )
    hints = typing.get_type_hints(SamplingParams)
    for f in fields(SamplingParams):
        if f.name in SERVER_SET:
            continue
        flag, hint = f"--{f.name.replace('_', '-')}", hints[f.name]
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        help_ = f"{f.metadata['help']} (default: {'unset' if default is None else default})"
        if f.name == "choice":
            sampling.add_argument(flag, action="append", default=None, help=f"{help_}; repeat for each")
        elif f.name == "logit_bias":
            sampling.add_argument(flag, type=_bias_entry, action="append", default=None, metavar="ID=BIAS",
                                  help=f"{help_}; repeat for each token")
        elif hint is bool:
            sampling.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typing.get_origin(hint) is list:
            kind = typing.get_args(hint)[0]
            sampling.add_argument(flag, type=kind, action="append", default=None, help=help_)
        else:
            kind = next(t for t in (*typing.get_args(hint), hint) if t in (int, float, str))
            sampling.add_argument(flag, type=kind, default=None, metavar=kind.__name__.upper(), help=help_)


def _bias_entry(text: str) -> tuple[int, float]:
    """--logit-bias ID=BIAS."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError(text)
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (a token id, a number), got {text!r}") from None


def completion_json(completion: Completion, ttft: float | None, total: float) -> dict[str, Any]:
    """`generate --json`: everything the server returned, plain JSON types."""

    def top(entry: Any) -> dict[str, Any]:
        return {"token_id": entry.token_id, "token": entry.token, "logprob": entry.logprob}

    return {
        "request_id": completion.request_id,
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "usage": {"prompt_tokens": completion.prompt_tokens,
                  "completion_tokens": completion.completion_tokens},
        "logprobs": [top(lp) | {"top": [top(t) for t in lp.top]} for lp in completion.logprobs] or None,
        "ttft_ms": None if ttft is None else round(ttft * 1e3, 3),
        "total_s": round(total, 6),
    }


def logprob_lines(completion: Completion) -> list[str]:
    """--logprobs in text form: one line per generated token, its logprob and the alternatives."""
    return [
        f"{lp.token!r:>16} {lp.logprob:9.4f}   " + "  ".join(f"{t.token!r} {t.logprob:.4f}" for t in lp.top)
        for lp in completion.logprobs
    ]


def http_hint(target: str, timeout: float = 2.0) -> str | None:
    """When target answers HTTP/1.x (the OpenAI HTTP port, say) rather than gRPC: one line saying
    so; else None. Asked only after a call failed, so it costs a working target nothing."""
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n".encode())
            head = sock.recv(16)
    except (OSError, ValueError):
        return None
    if not head.startswith(b"HTTP/1."):
        return None
    return (f"{target} is an HTTP port (the OpenAI-compatible API?), not gRPC: give --target the "
            f"gateway's gRPC port (--port, {DEFAULT_TARGET.rpartition(':')[2]} by default)")


def main(args: argparse.Namespace) -> int:
    sampling = {f.name: getattr(args, f.name) for f in fields(SamplingParams) if f.name not in SERVER_SET}
    if sampling["logit_bias"] is not None:
        sampling["logit_bias"] = dict(sampling["logit_bias"])
    prompt: Prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    completion = Completion()
    start = time.perf_counter()
    first = None
    security = {
        "tls": args.tls,
        "tls_root_cert": args.tls_root_cert,
        "tls_server_name": args.tls_server_name,
        "api_key": args.api_key,
    }
    with Client(args.target, **security) as client:
        try:
            for chunk in client.stream(
                prompt, timeout=args.timeout, request_id=args.request_id, app=args.app,
                cache_salt=args.cache_salt, **sampling
            ):
                first = first or time.perf_counter()
                completion.add(chunk)
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        except grpc.RpcError as exc:
            # Nothing came back: perhaps --target names the HTTP port (plaintext only: TLS would fail first).
            http = None if args.tls or args.tls_root_cert or first else http_hint(args.target)
            details = http or exc.details()
            if args.json:
                print(json.dumps({"error": {"code": exc.code().name, "message": details}}))
            else:
                line = details if http else f"{exc.code().name}: {details}"
                print(f"{chr(10) if first else ''}error: {line}", file=sys.stderr)
            return 1
    elapsed = time.perf_counter() - start
    ttft = None if first is None else first - start
    if args.json:
        print(json.dumps(completion_json(completion, ttft, elapsed)))
        return 0
    print()
    if completion.logprobs:
        print(f"{'token':>16} {'logprob':>9}   top {args.logprobs}")
        print("\n".join(logprob_lines(completion)))
    shown = "-" if ttft is None else f"{ttft * 1e3:.1f} ms"
    print(
        f"[{completion.request_id}] finish={completion.finish_reason} "
        f"prompt_tokens={completion.prompt_tokens} completion_tokens={completion.completion_tokens} "
        f"ttft={shown} total={elapsed:.2f} s",
        file=sys.stderr,
    )
    return 0
