"""The gRPC gateway process (`pipeserve gateway`): owns client streams and request state.

grpc.aio on uvloop; ZeroMQ (zmq.asyncio) to the rest of the pipeline. It binds `tokenize` (PUSH
TokenizeRequest to the tokenizer workers), `deltas` (PULL TextDeltas from the detokenizer), `errors`
(PULL RequestError from tokenizers/engine) and `status` (PULL EngineInfo heartbeats from the engine,
ProcessStatus from the supervisor), and connects `control` (PUSH Abort to the engine; one socket
per engine under data parallelism, where it also picks each request's engine: gateway/router.py).

It does no CPU-heavy work: validate, assign ids, admit, route each delta to its stream. It is the
one place a request's shape and sampling parameters are validated; the tokenizer checks only what
needs the tokenizer (prompt length, vocabulary), and the engine trusts both. Deltas
that arrive while a client is still reading land in its Stream's pending list, so a slow reader
gets them coalesced into one message instead of an unbounded queue. Any way a call ends without
its finish (cancel, deadline, Abort RPC, a pipeline failure) sends an Abort to the engine, and
the id stays reserved until the engine confirms, so a reused id can never meet a stale
tombstone or stale deltas.

It owns its port (SO_REUSEPORT off: a second server on the port fails to start instead of sharing
its calls), and its health service answers for one more service name, its instance id
($PIPESERVE_INSTANCE_ID, set by `pipeserve up`, else random): a readiness check for that name can only
be answered SERVING by this very process.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hmac
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import uvloop
import zmq
import zmq.asyncio
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from pipeserve import config as cfg
from pipeserve.config import (
    ABORTED_HOLD,
    TOKENIZER_FIELDS,
    Addresses,
    EngineConfig,
    GatewayConfig,
    engine_endpoints,
    new_instance_id,
)
from pipeserve.gateway.metrics import ServingMetrics
from pipeserve.gateway.pb import generation_pb2 as pb
from pipeserve.gateway.pb import generation_pb2_grpc as pb_grpc
from pipeserve.gateway.router import Router, prefix_blocks
from pipeserve.messages import (
    MAX_MESSAGE_BYTES,
    Abort,
    ChatMessage,
    EngineInfo,
    Message,
    MessageError,
    ModelInfo,
    ProcessStatus,
    RequestError,
    TextDeltas,
    TokenizeRequest,
    TokenLogprob,
    decode,
    encode,
    pack_ids,
    unpack_ids,
)
from pipeserve.sampling_params import SamplingParams

log = logging.getLogger("pipeserve.gateway")

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# proto3 `optional` fields: unset means the SamplingParams default.
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
MAX_REQUEST_ID_LEN = 256
MAX_CACHE_SALT_LEN = 256
MAX_MESSAGES = 1024
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_TOKEN_ID = 2**31 - 1  # ids travel as int32; the tokenizer checks them against the vocabulary
MONITOR_PERIOD = 0.1
PIPELINE = ("detokenizer",)  # processes whose death breaks every in-flight stream (an engine's: its own)
Failure = tuple[grpc.StatusCode, str]
Info = ModelInfo  # the wire type, by a name the ModelInfo RPC does not shadow in the class


class Reject(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def invalid(message: str) -> Reject:
    return Reject(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass
class Delta:
    """One TextDeltas row of a stream: new text, its token ids and, when asked, their logprobs."""

    text: str
    ids: np.ndarray
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # the first row of a request that asked


@dataclass
class Stream:
    """One engine request in flight (a gRPC Generate call, or one choice of an HTTP request)."""

    rid: str
    boot: int  # the engine incarnation it was admitted under
    engine: int = 0  # data parallel: the engine it was routed to
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    pending: list[Delta] = field(default_factory=list)  # not yet written
    started: bool = False  # some output arrived: the engine has it
    finish: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    error: Failure | None = None
    arrival: float = field(default_factory=time.monotonic)
    last_token: float = 0.0  # monotonic time of the latest token (inter-token latency)
    abort_in_engine: bool = True  # when closed without a finish, does the engine need an Abort?
    done: bool = False  # the final message was written

    def fail(self, code: grpc.StatusCode, message: str, abort_in_engine: bool) -> None:
        if self.error is None and not self.finish:
            self.error, self.abort_in_engine = (code, message), abort_in_engine
            self.wake.set()

    def take_rows(self, max_bytes: int) -> tuple[list[Delta], bool]:
        """Everything pending (cut at about max_bytes), and whether it ends the stream."""
        count, size = 0, 0
        for row in self.pending:
            count += 1
            size += len(row.text) * 4 + len(row.ids) * 8 + 64 * len(row.logprobs or ())
            if size >= max_bytes:
                break
        rows, self.pending = self.pending[:count], self.pending[count:]
        return rows, not self.pending and bool(self.finish)

    def response(self, rows: list[Delta], last: bool) -> pb.GenerateResponse:
        """Rows taken by take_rows() as one GenerateResponse (the last one with finish and usage)."""
        response = pb.GenerateResponse(request_id=self.rid, text="".join(r.text for r in rows))
        if rows:
            response.token_ids.extend(np.concatenate([r.ids for r in rows]).tolist())
        for row in rows:
            if row.logprobs:
                response.logprobs.extend(token_logprobs(row.logprobs))
            if row.prompt_logprobs:
                response.prompt_logprobs.extend(token_logprobs(row.prompt_logprobs))
        if last:
            response.finish_reason = self.finish
            response.usage.prompt_tokens = self.prompt_tokens
            response.usage.completion_tokens = self.completion_tokens
            response.usage.cached_prompt_tokens = self.cached_prompt_tokens
        return response


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


class Gateway(pb_grpc.GenerationServicer):
    def __init__(self, config: GatewayConfig, addrs: Addresses, instance_id: str = "",
                 tokenizer_config: EngineConfig | None = None) -> None:
        self.config, self.addrs = config, addrs
        self.instance_id = instance_id or new_instance_id()
        self.streams: dict[str, Stream] = {}
        self.aborted: dict[str, float] = {}  # rid -> monotonic expiry
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.info: ModelInfo | None = None
        self.router = Router(len(engine_endpoints(addrs.control)), config.dp_balance_threshold)
        self.detok_stats: dict[str, int] = {}
        self.pipeline_seen = float("-inf")
        self.fresh_after = float("-inf")  # detokenizer heartbeats older than this do not count (a restart)
        self.down: set[str] = set()  # pipeline processes (the detokenizer) reported down
        self.serving = False
        self.port = 0
        self.health = health.aio.HealthServicer()
        self._health_lock = asyncio.Lock()
        self._zmq = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task[None]] = []
        self._server: grpc.aio.Server | None = None
        self._metrics: Any = None
        self.metrics = ServingMetrics(self, time.monotonic)
        self.http: Any = None  # the OpenAI HTTP front end (pipeserve/gateway/openai.py), with --http-port
        self.tokenizer_config = tokenizer_config  # what /tokenize and /detokenize load, on first use
        self._tokenizer: Any = None

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> int:
        def socket(kind: int, addr: str, bind: bool) -> zmq.asyncio.Socket:
            sock = self._zmq.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # ZeroMQ refuses larger before we buffer them
            sock.bind(addr) if bind else sock.connect(addr)
            return sock

        self.tokenize = socket(zmq.PUSH, self.addrs.tokenize, True)
        self.deltas = socket(zmq.PULL, self.addrs.deltas, True)
        self.errors = socket(zmq.PULL, self.addrs.errors, True)
        self.status = socket(zmq.PULL, self.addrs.status, True)
        self.controls = [socket(zmq.PUSH, end, False) for end in engine_endpoints(self.addrs.control)]
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
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{self.config.host}:{self.config.port}"
        try:
            if self.config.tls_cert and self.config.tls_key:
                with open(self.config.tls_key, "rb") as key, open(self.config.tls_cert, "rb") as cert:
                    credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
                self.port = server.add_secure_port(address, credentials)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:  # grpc versions differ: some raise, some return port 0
            self.port = 0
        if not self.port:
            self._zmq.destroy(linger=0)
            raise PortInUse(self.config.host, self.config.port)
        if self.config.http_port is not None:
            from pipeserve.gateway.openai import OpenAIServer  # FastAPI: only when HTTP is on

            self.http = OpenAIServer(self, self._load_tokenizer)
            try:
                await self.http.start(self.config.host, self.config.http_port)
            except OSError:
                self._zmq.destroy(linger=0)
                raise PortInUse(self.config.host, self.config.http_port, "--http-port") from None
        await self._set_health(False)
        await server.start()
        self._server = server
        self._tasks = [
            asyncio.create_task(coro)
            for coro in (self._recv_deltas(), self._recv_errors(), self._recv_status(), self._monitor())
        ]
        if self.config.metrics_port is not None:
            registry = self.metrics.registry
            self._metrics = start_http_server(self.config.metrics_port, self.config.host, registry)
        return self.port

    async def stop(self, grace: float) -> None:
        """Stop taking calls, let in-flight streams finish within grace, then cancel the rest."""
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
        if self.http is not None:
            await self.http.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._metrics is not None:
            self._metrics[0].shutdown()
        self._zmq.destroy(linger=0)

    # ---- RPCs ------------------------------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest | DecodeError, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if isinstance(request, DecodeError):
            self.outcomes[grpc.StatusCode.INVALID_ARGUMENT.name] += 1
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is not a valid GenerateRequest ({request}); string fields such as prompt, "
                "stop and messages must be valid UTF-8",
            )
            return
        try:
            (stream,) = await self.submit(request, request.request_id or uuid.uuid4().hex)
        except Reject as reject:
            await context.abort(reject.code, reject.message)
        # Both paths: grpc.aio does not always raise CancelledError into the handler on a cancel.
        context.add_done_callback(lambda _: self.close(stream))
        try:
            async for rows, last in self.output(stream):
                yield stream.response(rows, last)
        except Reject as reject:
            await context.abort(reject.code, reject.message)
        except asyncio.CancelledError:
            self.close(stream)
            raise
        finally:
            self.close(stream)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        stream = self.streams.get(request.request_id)
        if stream is None or stream.finish or stream.error is not None:
            return pb.AbortResponse(found=False)
        self._abort_in_engine([stream.rid], stream.engine)
        stream.finish = "abort"  # the stream ends now; the engine's own finish is awaited in self.aborted
        stream.wake.set()
        return pb.AbortResponse(found=True)

    async def ModelInfo(
        self,
        request: pb.ModelInfoRequest,
        context: grpc.aio.ServicerContext,
    ) -> pb.ModelInfoResponse:
        if self.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine has not reported yet")
        fields = pb.ModelInfoResponse.DESCRIPTOR.fields_by_name
        response = pb.ModelInfoResponse(**{k: v for k, v in vars(self.info).items() if k in fields})
        engines = self.router.engines
        response.data_parallel_size = len(engines)
        response.tensor_parallel_size = max(view.tensor_parallel_size for view in engines)
        for i, view in enumerate(engines):
            response.engines.add(index=i, serving=view.live, running=view.stats.get("running", 0),
                                 waiting=view.stats.get("waiting", 0), routed=view.routed)
        return response

    # ---- the request lifecycle both front ends share (gRPC here, HTTP in openai.py) ----------
    async def submit(self, request: pb.GenerateRequest, rid: str, n: int = 1,
                     fit_max_tokens: bool = False) -> list[Stream]:
        """Validate and admit a request (Reject otherwise), open its streams and send it to be
        tokenized. n > 1: n engine requests (ids `rid-0`...) sharing one tokenization, each with
        its own seed stream (seed + i when the request has a seed). fit_max_tokens: a request
        without max_tokens may generate up to the end of the context (OpenAI chat)."""
        if fit_max_tokens and not request.HasField("max_tokens") and self.info is not None:
            request.max_tokens = self.info.context_length
        try:
            message = self._admit(request, rid, n)
            message.fit_max_tokens = fit_max_tokens
        except Reject as reject:
            self.outcomes[reject.code.name] += 1
            raise
        streams = [Stream(r, self.router.engines[message.engine].boot, message.engine)
                   for r in message.engine_rids()]
        for stream in streams:
            self.streams[stream.rid] = stream
        await self.tokenize.send(encode(message))
        return streams

    async def output(self, stream: Stream) -> AsyncIterator[tuple[list[Delta], bool]]:
        """The stream's output as it arrives: at each wake-up everything pending (cut at
        --max-response-bytes) and whether that ends the stream; Reject when the stream failed."""
        while True:
            if not stream.pending and not stream.finish and stream.error is None:
                stream.wake.clear()
                await stream.wake.wait()
            if stream.error is not None:
                self.close(stream)
                raise Reject(*stream.error)
            rows, last = stream.take_rows(self.config.max_response_bytes)
            stream.done = last  # the engine is done with it: closing it now needs no Abort
            yield rows, last
            if last:
                return

    def model_info(self) -> Info | None:
        return self.info

    def _load_tokenizer(self) -> Any:
        """The served tokenizer as a tokenizer worker holds it (loaded once, on a worker thread)."""
        if self._tokenizer is None:
            from pipeserve.tokenizer.load import load_for
            from pipeserve.tokenizer.worker import Tokenizer

            config = self.tokenizer_config or EngineConfig(model=os.environ.get("PIPESERVE_MODEL"))
            tokenizer = load_for(config)[1]
            context = self.info.context_length if self.info else tokenizer.model_max_length
            self._tokenizer = Tokenizer(tokenizer, context, self.info.vocab_size if self.info else None)
        return self._tokenizer

    # ---- admission -------------------------------------------------------------------------
    def _admit(self, request: pb.GenerateRequest, rid: str, n: int = 1) -> TokenizeRequest:
        """Validate and admit, or raise Reject with the status code and a message naming the field."""
        # Capacity first: under overload most calls are refused, so a refusal must cost nothing
        # beyond this count (no field checks, no SamplingParams).
        if len(self.streams) + n > self.config.max_inflight:
            raise Reject(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self.streams)} requests in flight, the limit is {self.config.max_inflight}",
            )
        if len(rid) > MAX_REQUEST_ID_LEN:
            raise invalid(f"request_id is {len(rid)} characters, at most {MAX_REQUEST_ID_LEN} allowed")
        which = request.WhichOneof("input")
        size = request.ByteSize()
        if size > self.config.max_request_bytes:
            raise invalid(
                f"{which or 'request'} is too large: the request is {size} bytes, "
                f"at most {self.config.max_request_bytes} allowed"
            )
        # Unset fields take the model's generation_config.json defaults (as vLLM), then SamplingParams'.
        sampling: dict[str, Any] = dict(self.info.sampling_defaults) if self.info else {}
        sampling.update({name: getattr(request, name) for name in OPTIONAL_SAMPLING
                         if request.HasField(name)})
        constraint = request.WhichOneof("constraint")
        if constraint == "choice":
            sampling["choice"] = list(request.choice.choices)
        elif constraint is not None:
            sampling[constraint] = getattr(request, constraint)
        params = SamplingParams(
            **sampling,
            stop=list(request.stop),
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
        )
        try:
            params.validate(max_logprobs=self.info.max_logprobs if self.info else 20)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        if len(request.cache_salt) > MAX_CACHE_SALT_LEN:
            raise invalid(
                f"cache_salt is {len(request.cache_salt)} characters, at most {MAX_CACHE_SALT_LEN} allowed"
            )
        message = TokenizeRequest(rid=rid, sampling=params, app=request.app, arrival=time.time(),
                                  cache_salt=request.cache_salt, n=n)
        if which is None:
            raise invalid("prompt is missing: set one of prompt, prompt_token_ids or messages")
        if which == "prompt":
            if not request.prompt.strip():
                raise invalid("prompt must not be empty or only whitespace")
            message.prompt = request.prompt
        elif which == "prompt_token_ids":
            ids = np.asarray(request.prompt_token_ids.ids, dtype=np.int64)
            if not len(ids):
                raise invalid("prompt_token_ids must not be empty")
            if ids.max() > MAX_TOKEN_ID:
                raise invalid(f"prompt_token_ids has id {int(ids.max())}, above the largest token id "
                              f"{MAX_TOKEN_ID}")
            message.prompt_ids = pack_ids(ids)
        else:
            chat = request.messages.messages
            if not chat or len(chat) > MAX_MESSAGES:
                raise invalid(f"messages must hold 1 to {MAX_MESSAGES} messages, got {len(chat)}")
            for i, m in enumerate(chat):
                if m.role not in CHAT_ROLES:
                    raise invalid(f"messages[{i}].role is {m.role!r}, not one of {', '.join(CHAT_ROLES)}")
            message.messages = [ChatMessage(m.role, m.content) for m in chat]
        if any(r in self.streams or r in self.aborted for r in message.engine_rids()):
            raise Reject(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in flight")
        if not self.serving:
            raise Reject(grpc.StatusCode.UNAVAILABLE, self._why_not_serving())
        message.engine = self.router.pick(self._prefix(request) if len(self.router.engines) > 1 else [], n)
        return message

    def _prefix(self, request: pb.GenerateRequest) -> list[bytes]:
        """The request's prefix blocks for affinity routing (gateway/router.py)."""
        which = request.WhichOneof("input")
        if which == "prompt_token_ids":
            ids = np.asarray(request.prompt_token_ids.ids, dtype=np.int64)
            return prefix_blocks(request.cache_salt, ids=ids, page=self.info.page_size if self.info else 16)
        if which == "messages":
            text = "".join(f"{m.role}\n{m.content}\n" for m in request.messages.messages)
        else:
            text = request.prompt
        return prefix_blocks(request.cache_salt, text=text)

    # ---- request state ---------------------------------------------------------------------
    def close(self, stream: Stream) -> None:
        """Idempotent end of a stream, however it ended: one closed before its finish is aborted in
        the engine."""
        if self.streams.get(stream.rid) is not stream:
            return
        del self.streams[stream.rid]
        if stream.done:
            self.outcomes[stream.finish] += 1
        else:
            self.outcomes[stream.error[0].name if stream.error else "CANCELLED"] += 1
            if not stream.finish and stream.abort_in_engine:
                self._abort_in_engine([stream.rid], stream.engine)
        stream.done = True

    def _abort_in_engine(self, rids: list[str], engine: int) -> None:
        """Abort rids in the engine running them (only there: an abort elsewhere would leave a
        tombstone that could end a later request reusing the id)."""
        expiry = time.monotonic() + ABORTED_HOLD
        for rid in rids:
            self.aborted[rid] = expiry
        future = self.controls[engine].send(encode(Abort(rids=rids)))
        future.add_done_callback(_log_failure)  # type: ignore[attr-defined]  # pyzmq types it as Awaitable

    def _fail(
        self,
        code: grpc.StatusCode,
        message: str,
        abort_in_engine: bool,
        which: Callable[[Stream], bool] = lambda s: True,
    ) -> None:
        victims = [s for s in self.streams.values() if s.error is None and not s.finish and which(s)]
        for stream in victims:
            stream.fail(code, message, abort_in_engine=False)  # one batched Abort below
        if abort_in_engine:
            for engine in sorted({s.engine for s in victims}):
                self._abort_in_engine([s.rid for s in victims if s.engine == engine], engine)
        if victims:
            log.warning("%d streams end with %s: %s", len(victims), code.name, message)

    # ---- pipeline input --------------------------------------------------------------------
    async def _recv_deltas(self) -> None:
        while True:
            msg = _decode(await self.deltas.recv(), "deltas")
            if isinstance(msg, TextDeltas):
                self._route(msg)
            elif msg is not None:
                log.warning("dropped a %s message on the deltas socket", msg.TAG)

    def _route(self, msg: TextDeltas) -> None:
        n = len(msg.rids)
        ids = unpack_ids(msg.tokens)
        if (
            len(msg.offsets) != n + 1
            or any(len(c) != n for c in (msg.text, msg.finish, msg.prompt_tokens, msg.completion_tokens,
                                         msg.cached_prompt_tokens))
            or (msg.logprobs is not None and len(msg.logprobs) != n)
            or len(msg.queue_time) not in (0, n)
            or (msg.prompt_logprobs is not None and len(msg.prompt_logprobs) != n)
            or (msg.row_engines is not None and len(msg.row_engines) != n)
            or (n and msg.offsets[-1] > len(ids))
        ):
            log.warning("dropped a malformed TextDeltas of %d rows", n)
            return
        now = self.pipeline_seen = time.monotonic()
        if msg.stats is not None:
            self.detok_stats.update(msg.stats)
        for key, stats in (msg.engines or {}).items():
            if key.isdigit() and int(key) < len(self.router.engines):
                self.router.report(int(key), stats, heartbeat=False)
        orphans: list[tuple[int, str]] = []
        for i, rid in enumerate(msg.rids):
            stream = self.streams.get(rid)
            if stream is None or stream.finish or stream.error is not None:
                if msg.finish[i]:
                    self.aborted.pop(rid, None)  # the engine is done with it: the id is free again
                elif stream is None and rid not in self.aborted:
                    # Output nobody reads (its abort was lost): stop it, in the engine running it.
                    engine = msg.row_engines[i] if msg.row_engines is not None else 0
                    if 0 <= engine < len(self.controls):
                        orphans.append((engine, rid))
                continue
            stream.started = True
            row_ids = ids[msg.offsets[i] : msg.offsets[i + 1]]
            stream.pending.append(Delta(msg.text[i], row_ids, msg.logprobs[i] if msg.logprobs else None,
                                        msg.prompt_logprobs[i] if msg.prompt_logprobs else None))
            stream.prompt_tokens, stream.completion_tokens = msg.prompt_tokens[i], msg.completion_tokens[i]
            stream.cached_prompt_tokens = msg.cached_prompt_tokens[i]
            stream.finish = msg.finish[i]
            if len(row_ids):
                queue_time = msg.queue_time[i] if msg.queue_time else 0.0
                self.metrics.tokens(stream.arrival, stream.last_token, len(row_ids), stream.prompt_tokens,
                                    queue_time, now)
                stream.last_token = now
            if stream.finish:
                self.metrics.finished(stream.arrival, stream.finish, stream.prompt_tokens,
                                      stream.completion_tokens, now)
            stream.wake.set()
        if orphans:
            log.warning("aborting %d requests run for no stream, e.g. %s", len(orphans), orphans[0][1])
            for engine in sorted({engine for engine, _ in orphans}):
                self._abort_in_engine([rid for where, rid in orphans if where == engine], engine)

    async def _recv_errors(self) -> None:
        while True:
            msg = _decode(await self.errors.recv(), "errors")
            if isinstance(msg, RequestError):
                self._on_request_error(msg)
            elif msg is not None:
                log.warning("dropped a %s message on the errors socket", msg.TAG)

    async def _recv_status(self) -> None:
        while True:
            msg = _decode(await self.status.recv(), "status")
            if isinstance(msg, EngineInfo):
                self._on_engine_info(msg)
            elif isinstance(msg, ProcessStatus):
                self._on_process(msg)
                await self._update_health()  # now, not at the next monitor tick
            elif msg is not None:
                log.warning("dropped a %s message on the status socket", msg.TAG)

    def _on_request_error(self, msg: RequestError) -> None:
        stream = self.streams.get(msg.rid)
        if stream is None:
            self.aborted.pop(msg.rid, None)
            return
        code = getattr(grpc.StatusCode, msg.code, grpc.StatusCode.INTERNAL)
        if not isinstance(code, grpc.StatusCode) or code is grpc.StatusCode.OK:
            code = grpc.StatusCode.INTERNAL
        stream.fail(code, msg.message, abort_in_engine=False)

    def _on_engine_info(self, msg: EngineInfo) -> None:
        if not 0 <= msg.engine < len(self.router.engines):
            log.warning("dropped a heartbeat of engine %d: this gateway has %d engines (--control)",
                        msg.engine, len(self.router.engines))
            return
        view, index = self.router.engines[msg.engine], msg.engine
        if msg.boot != view.boot:
            if view.boot:  # a new engine: the old one's requests are gone (aborted: see _on_process)
                self._fail(grpc.StatusCode.UNAVAILABLE, f"engine {index} restarted", True,
                           lambda s: on_engine(index)(s) and s.boot != msg.boot)
                self.router.forget(index)
            log.info("engine %d (boot %d) up: %s", index, msg.boot, msg.info)
            view.boot = msg.boot
        self.info = msg.info
        self.metrics.set_context(msg.info.context_length)
        view.seen = time.monotonic()
        view.tensor_parallel_size = msg.tensor_parallel_size
        if msg.stats is not None:
            self.router.report(index, msg.stats, heartbeat=True)

    def _on_process(self, msg: ProcessStatus) -> None:
        log.info("supervisor: %s is %s", msg.process, "up" if msg.up else "down")
        index = engine_index(msg.process)
        if index is not None and index < len(self.router.engines):
            view = self.router.engines[index]
            if msg.up:
                view.down = False
                view.fresh_after = time.monotonic()  # serving again only after a fresh heartbeat
            else:
                view.down = True
                # Aborted in that engine too: its successor may still get adds queued on the way
                # (tombstones drop them). The other engines' requests go on.
                self._fail(grpc.StatusCode.UNAVAILABLE, f"the engine {index} died", abort_in_engine=True,
                           which=on_engine(index))
        elif msg.process in PIPELINE:
            if msg.up:
                self.down.discard(msg.process)
                self.fresh_after = time.monotonic()  # SERVING again only after fresh heartbeats
            else:
                self.down.add(msg.process)
                # Abort them in the engine too: a dead detokenizer leaves them running there, and a
                # dead engine's successor may still get adds queued on the way (tombstones drop them).
                self._fail(grpc.StatusCode.UNAVAILABLE, f"the {msg.process} died", abort_in_engine=True)
        elif msg.process.startswith("tokenizer") and not msg.up:
            # Requests queued at the dead worker are lost; the gateway cannot tell which ones (PUSH
            # round-robin), so every request without output yet ends UNAVAILABLE, aborted everywhere.
            self._fail(
                grpc.StatusCode.UNAVAILABLE,
                f"{msg.process} died before this request started",
                abort_in_engine=True,
                which=lambda s: not s.started,
            )

    # ---- health ----------------------------------------------------------------------------
    def _healthy(self) -> bool:
        """SERVING: the detokenizer's output flows and at least one engine is live (as of _update_health)."""
        now, timeout = time.monotonic(), self.config.liveness_timeout
        return (
            not self.down
            and self.info is not None
            and self.fresh_after < self.pipeline_seen
            and now - self.pipeline_seen < timeout
            and any(view.live for view in self.router.engines)
        )

    def _why_not_serving(self) -> str:
        dead = [f"engine-{i}" for i, view in enumerate(self.router.engines) if view.down]
        if self.down or len(dead) == len(self.router.engines):
            return f"not serving: {', '.join(sorted(self.down | set(dead)))} down"
        if self.info is None:
            return "not serving: the engine has not reported yet"
        return "not serving: no heartbeat from the engine and detokenizer"

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE, self.instance_id):
            await self.health.set(service, status)

    async def _update_health(self) -> None:
        async with self._health_lock:  # the monitor and the errors receiver both call this
            now = time.monotonic()
            for index, view in enumerate(self.router.engines):
                live = view.is_live(now, self.config.liveness_timeout)
                if live != view.live:
                    log.info("engine %d: %s", index, "serving" if live else "not serving")
                    view.live = live
                    if not live:  # its streams end; the other engines' go on
                        self._fail(grpc.StatusCode.UNAVAILABLE, f"engine {index} stopped responding", True,
                                   on_engine(index))
            healthy = self._healthy()
            if healthy != self.serving:
                self.serving = healthy  # admission follows at once, the health service right after
                log.info("health: %s", "SERVING" if healthy else "NOT_SERVING")
                if not healthy:
                    self._fail(grpc.StatusCode.UNAVAILABLE, self._why_not_serving(), abort_in_engine=True)
                await self._set_health(healthy)

    async def _monitor(self) -> None:
        """Liveness is a matter of time: re-check it, and expire aborted ids, every tick."""
        while True:
            await self._update_health()
            now = time.monotonic()
            for rid in [rid for rid, expiry in self.aborted.items() if expiry < now]:
                del self.aborted[rid]
            await asyncio.sleep(MONITOR_PERIOD)


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


def on_engine(engine: int) -> Callable[[Stream], bool]:
    """Selects the streams routed to one engine (for _fail)."""
    return lambda stream: stream.engine == engine


def engine_index(process: str) -> int | None:
    """The engine a supervisor's process name is ("engine-1": 1; "engine": 0), None for the others."""
    if process == "engine":
        return 0
    prefix, _, index = process.partition("-")
    return int(index) if prefix == "engine" and index.isdigit() else None


def parse_request(data: bytes) -> pb.GenerateRequest | DecodeError:
    """GenerateRequest.FromString that returns the error instead of raising it (see start())."""
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as exc:
        return exc


def _decode(data: bytes, where: str) -> Message | None:
    try:
        return decode(data)
    except MessageError as exc:
        log.warning("dropped a malformed message on %s: %s", where, exc)
        return None


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("zmq send failed: %s", future.exception())


class PortInUse(OSError):
    def __init__(self, host: str, port: int, flag: str = "--port") -> None:
        super().__init__(f"cannot listen on {host}:{port}: the port is in use (another pipeserve?); "
                         f"stop that server or pick another {flag}")


async def serve(config: GatewayConfig, addrs: Addresses, tokenizer: EngineConfig | None = None) -> int:
    gateway = Gateway(config, addrs, os.environ.get("PIPESERVE_INSTANCE_ID", ""), tokenizer)
    try:
        port = await gateway.start()
    except PortInUse as exc:
        log.error("%s", exc)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("gateway listening on %s:%d (instance %s)", config.host, port, gateway.instance_id)
    if gateway.http is not None:
        log.info("OpenAI-compatible HTTP API on %s:%d", config.host, gateway.http.port)
    await stop.wait()
    log.info("shutting down, %d streams get %.1f s to finish", len(gateway.streams), config.grace)
    await gateway.stop(config.grace)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, GatewayConfig)
    cfg.add_arguments(parser, Addresses)
    cfg.add_arguments(parser, EngineConfig, only=TOKENIZER_FIELDS)  # the tokenizer /tokenize serves


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args.model = args.model or os.environ.get("PIPESERVE_MODEL")
    tokenizer = cfg.from_args(EngineConfig, args)
    return uvloop.run(serve(cfg.from_args(GatewayConfig, args), cfg.from_args(Addresses, args), tokenizer))
