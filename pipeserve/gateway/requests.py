"""The gateway's core, shared by its front ends (gRPC: grpc_api.py, HTTP: openai_api.py): request
state and the pipeline's sockets, free of any transport.

It binds `tokenize` (a ROUTER: each TokenizeRequest to one tokenizer worker in turn, and later its
Abort to the same worker, which forwards it to the engine behind the add; the workers announce
themselves with WorkerReady), `deltas` (PULL TextDeltas from the detokenizer), `errors` (PULL
RequestError from tokenizers/engine) and `status` (PULL EngineInfo heartbeats, with each engine's
counters, from the engines; ProcessStatus from the supervisor), and connects `control` (PUSH Abort
to the engine, for requests whose output already came, which the engine therefore holds; one socket
per engine under data parallelism, where it also picks each request's engine: gateway/router.py).

It does no CPU-heavy work: validate, assign ids, admit, route each delta to its stream. It is the
one place a request's shape and sampling parameters are validated (a front end only turns its
transport's request into SamplingParams and a Prompt); the tokenizer checks only what needs the
tokenizer (prompt length, vocabulary), and the engine trusts both. Deltas that arrive while a
client is still reading land in its Stream's pending list, so a slow reader gets them coalesced
into one message instead of an unbounded queue. Any way a call ends without its finish (cancel,
deadline, abort, a pipeline failure) sends an Abort to the engine, ordered behind its add, and the
id stays reserved until the engine confirms (its finish or error arrives; ABORTED_HOLD bounds the
wait), so a client reusing its request id can never meet the old request's deltas.

Refusals and failures carry a neutral ErrorCode; each front end maps it to its own status (gRPC
status code, HTTP status).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import errno
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from pipeserve.config import ABORTED_HOLD, Addresses, GatewayConfig, InternalAuth, engine_endpoints
from pipeserve.gateway.adapters import Adapters
from pipeserve.gateway.health import PIPELINE, PipelineHealth, engine_index
from pipeserve.gateway.metrics import ServingMetrics
from pipeserve.gateway.router import Router, prefix_blocks
from pipeserve.messages import (
    MAX_MESSAGE_BYTES,
    Abort,
    ChatMessage,
    EngineInfo,
    LogprobsJSON,
    Message,
    MessageError,
    ModelInfo,
    ProcessStatus,
    RequestError,
    TextDeltas,
    TokenizeRequest,
    TokenLogprob,
    WorkerReady,
    decode,
    encode,
    pack_ids,
    unpack_floats,
    unpack_ids,
)
from pipeserve.sampling_params import SamplingParams
from pipeserve.zmq_auth import InternalSockets

log = logging.getLogger("pipeserve.gateway")

MAX_REQUEST_ID_LEN = 256
MAX_CACHE_SALT_LEN = 256
MAX_MESSAGES = 1024
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_TOKEN_ID = 2**31 - 1  # ids travel as int32; the tokenizer checks them against the vocabulary
MONITOR_PERIOD = 0.1
# A deltas message this large (logprob tables, many choices) is decoded on a worker thread: the loop
# keeps answering (health, metrics, other streams) while it is, the GIL handing it turns. Smaller ones
# decode in well under a millisecond.
OFF_LOOP_BYTES = 16 * 1024
TURN_BUDGET = 0.002  # seconds of routing before the deltas receiver lets the loop run something else
# A request's input: text, token ids (an integer array) or chat messages.
Prompt = str | np.ndarray | list[ChatMessage]


class ErrorCode(enum.Enum):
    """Why a request was refused or failed; the names are those RequestError.code carries."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"

    @classmethod
    def parse(cls, name: str) -> ErrorCode:
        """A wire code; anything unknown is INTERNAL."""
        try:
            return cls(name)
        except ValueError:
            return cls.INTERNAL


class Refusal(Exception):
    """A request refused or failed: a neutral code and a message naming the field at fault."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def invalid(message: str) -> Refusal:
    return Refusal(ErrorCode.INVALID_ARGUMENT, message)


@dataclass
class Delta:
    """One TextDeltas row of a stream: new text, its token ids and, when asked, their logprobs."""

    text: str
    ids: np.ndarray
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # the first row of a request that asked
    # The same, rendered by the detokenizer as OpenAI JSON (a request submitted with a logprobs_format).
    logprobs_json: LogprobsJSON | None = None
    prompt_logprobs_json: LogprobsJSON | None = None
    embedding: np.ndarray | None = None  # an embedding request's vector (float32), with its finish


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
    error: Refusal | None = None
    arrival: float = field(default_factory=time.monotonic)
    last_token: float = 0.0  # monotonic time of the latest token (inter-token latency)
    abort_in_engine: bool = True  # when closed without a finish, does the engine need an Abort?
    done: bool = False  # the final message was written
    worker: bytes = b""  # the tokenizer worker that took its add (its abort goes the same way)

    def fail(self, code: ErrorCode, message: str, abort_in_engine: bool) -> None:
        if self.error is None and not self.finish:
            self.error, self.abort_in_engine = Refusal(code, message), abort_in_engine
            self.wake.set()

    def take_rows(self, max_bytes: int) -> tuple[list[Delta], bool]:
        """Everything pending (cut at about max_bytes), and whether it ends the stream."""
        count, size = 0, 0
        for row in self.pending:
            count += 1
            size += len(row.text) * 4 + len(row.ids) * 8 + 64 * len(row.logprobs or ())
            if row.logprobs_json is not None:
                size += sum(map(len, row.logprobs_json.parts))
            if size >= max_bytes:
                break
        rows, self.pending = self.pending[:count], self.pending[count:]
        return rows, not self.pending and bool(self.finish)


class Core:
    """Request state, admission and the pipeline's sockets; the front ends call submit / output /
    close / abort and read serving, info and metrics."""

    def __init__(self, config: GatewayConfig, addrs: Addresses) -> None:
        self.config, self.addrs = config, addrs
        self.streams: dict[str, Stream] = {}
        self.aborted: dict[str, float] = {}  # rid -> monotonic expiry
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.info: ModelInfo | None = None
        self.adapters = Adapters()  # the LoRA adapters requests may name (the server sets them)
        self.router = Router(len(engine_endpoints(addrs.control)), config.dp_balance_threshold)
        self.detok_stats: dict[str, int] = {}
        self.workers: list[bytes] = []  # tokenizer workers' routing ids, in announcement order
        self._turn = 0  # the next request's worker: workers[_turn % len(workers)]
        self.health = PipelineHealth()
        self.serving = False
        # Called with the new state whenever serving changes (the gRPC health service follows it).
        self.on_serving: list[Callable[[bool], Awaitable[None]]] = []
        self._health_lock = asyncio.Lock()
        self._zmq = zmq.asyncio.Context()
        self.internal = InternalSockets(self._zmq, InternalAuth(), "gateway")
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics = ServingMetrics(self, time.monotonic)

    # ---- lifecycle -------------------------------------------------------------------------
    def bind(self) -> None:
        """Bind and connect the pipeline's sockets (before any front end takes calls)."""

        def socket(kind: int, addr: str, bind: bool, **options: int) -> zmq.asyncio.Socket:
            sock = self._zmq.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # ZeroMQ refuses larger before we buffer them
            for option, value in options.items():
                sock.setsockopt(getattr(zmq, option), value)
            self.internal.bind(sock, addr) if bind else self.internal.connect(sock, addr)
            return sock

        # ROUTER_MANDATORY: a send to a worker that left fails (and picks another) instead of vanishing;
        # no send limit: admission (--max-inflight) bounds what can queue.
        self.tokenize = socket(zmq.ROUTER, self.addrs.tokenize, True, ROUTER_MANDATORY=1, SNDHWM=0)
        self.deltas = socket(zmq.PULL, self.addrs.deltas, True)
        self.errors = socket(zmq.PULL, self.addrs.errors, True)
        self.status = socket(zmq.PULL, self.addrs.status, True)
        self.controls = [socket(zmq.PUSH, end, False) for end in engine_endpoints(self.addrs.control)]

    def start(self) -> None:
        """Start receiving from the pipeline and watching its health."""
        self._tasks = [
            asyncio.create_task(coro)
            for coro in (self._recv_deltas(), self._recv_errors(), self._recv_status(), self._recv_workers(),
                         self._monitor())
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.internal.close()
        self._zmq.destroy(linger=0)

    # ---- the request lifecycle -------------------------------------------------------------
    def refused(self, refusal: Refusal) -> Refusal:
        """Count a refusal a front end decided on its own (its transport's limits); returns it."""
        self.outcomes[refusal.code.name] += 1
        return refusal

    def sampling(self, given: dict[str, Any], fit_max_tokens: bool = False) -> SamplingParams:
        """SamplingParams from the fields a client gave (None or absent: unset), validated. Unset
        fields take the model's generation_config.json defaults (as vLLM), then SamplingParams'.
        fit_max_tokens: without max_tokens a request may generate up to the end of the context
        (OpenAI chat; the tokenizer lowers it to what the prompt leaves)."""
        values: dict[str, Any] = dict(self.info.sampling_defaults) if self.info else {}
        values.update({k: v for k, v in given.items() if v is not None})
        if fit_max_tokens and given.get("max_tokens") is None and self.info is not None:
            values["max_tokens"] = self.info.context_length
        try:
            params = SamplingParams(**values)
            params.validate(max_logprobs=self.info.max_logprobs if self.info else 20,
                            vocab_size=self.info.vocab_size if self.info else None)
        except (ValueError, TypeError) as exc:
            raise self.refused(invalid(str(exc))) from None
        return params

    async def submit(self, params: SamplingParams, prompt: Prompt, rid: str, *, n: int = 1, app: str = "",
                     cache_salt: str = "", fit_max_tokens: bool = False,
                     tools: list[dict[str, Any]] | None = None, logprobs_format: str = "",
                     embed: bool = False, lora: str = "") -> list[Stream]:
        """Admit a request (Refusal otherwise), open its streams and send it to be tokenized. n > 1:
        n engine requests (ids `rid-0`...) sharing one tokenization, each with its own seed stream
        (seed + i when the request has a seed). logprobs_format: how its logprobs come (messages.
        LOGPROBS_FORMATS; an OpenAI one: rendered, in its deltas' logprobs_json). embed: an embedding
        request (gateway/embeddings.py). lora: the name of its LoRA adapter ("": the base model; an
        unknown name is NOT_FOUND)."""
        try:
            adapter = self.adapters.get(lora) if lora else None
            if lora and adapter is None:
                raise Refusal(ErrorCode.NOT_FOUND, f"the LoRA adapter {lora!r} does not exist" + (
                    "" if self.adapters.enabled else " (this server runs without --enable-lora)"))
            message = self._admit(params, prompt, rid, n, app, cache_salt)
            if adapter is not None:  # the engine keys its prefix cache by adapter too
                message.lora_name, message.lora_id, message.lora_path = (lora, adapter.lora_int_id,
                                                                         adapter.lora_path)
        except Refusal as refusal:
            raise self.refused(refusal) from None
        message.fit_max_tokens, message.tools = fit_max_tokens, tools
        message.logprobs_format = logprobs_format
        message.embed = embed
        data = encode(message)
        while True:
            worker = self._worker()
            if worker is None:
                why = "not serving: no tokenizer worker is connected"
                raise self.refused(Refusal(ErrorCode.UNAVAILABLE, why))
            if self._to_worker(worker, data):
                break
        streams = [Stream(r, self.router.engines[message.engine].boot, message.engine, worker=worker)
                   for r in message.engine_rids()]
        for stream in streams:
            self.streams[stream.rid] = stream
        return streams

    async def output(self, stream: Stream) -> AsyncIterator[tuple[list[Delta], bool]]:
        """The stream's output as it arrives: at each wake-up everything pending (cut at
        --max-response-bytes) and whether that ends the stream; Refusal when the stream failed."""
        while True:
            if not stream.pending and not stream.finish and stream.error is None:
                stream.wake.clear()
                await stream.wake.wait()
            if stream.error is not None:
                self.close(stream)
                raise stream.error
            rows, last = stream.take_rows(self.config.max_response_bytes)
            stream.done = last  # the engine is done with it: closing it now needs no Abort
            yield rows, last
            if last:
                return

    def close(self, stream: Stream) -> None:
        """Idempotent end of a stream, however it ended: one closed before its finish is aborted in
        the engine."""
        if self.streams.get(stream.rid) is not stream:
            return
        del self.streams[stream.rid]
        if stream.done:
            self.outcomes[stream.finish] += 1
        else:
            self.outcomes[stream.error.code.name if stream.error else ErrorCode.CANCELLED.name] += 1
            if stream.error is None and not stream.finish:  # the client left: a request aborted
                self.metrics.aborted()
            if not stream.finish and stream.abort_in_engine:
                self._abort([stream])
        stream.done = True

    def abort(self, rid: str) -> bool:
        """A client's explicit abort of an in-flight request: it ends now with finish "abort";
        whether it was in flight."""
        stream = self.streams.get(rid)
        if stream is None or stream.finish or stream.error is not None:
            return False
        self._abort([stream])
        stream.finish = "abort"  # the stream ends now; the engine's own finish is awaited in self.aborted
        self.metrics.aborted()
        stream.wake.set()
        return True

    def model_info(self) -> ModelInfo | None:
        return self.info

    @property
    def zmq_refused(self) -> int:
        """Peers refused on this gateway's tcp:// sockets (pipeserve/zmq_auth.py)."""
        return self.internal.refused

    # ---- admission -------------------------------------------------------------------------
    def _admit(self, params: SamplingParams, prompt: Prompt, rid: str, n: int, app: str,
               cache_salt: str) -> TokenizeRequest:
        """Validate and admit, or raise Refusal with a message naming the field."""
        # Capacity first: under overload most calls are refused, so a refusal must cost nothing
        # beyond this count.
        if len(self.streams) + n > self.config.max_inflight:
            raise Refusal(ErrorCode.RESOURCE_EXHAUSTED,
                          f"{len(self.streams)} requests in flight, the limit is {self.config.max_inflight}")
        if len(rid) > MAX_REQUEST_ID_LEN:
            raise invalid(f"request_id is {len(rid)} characters, at most {MAX_REQUEST_ID_LEN} allowed")
        if len(cache_salt) > MAX_CACHE_SALT_LEN:
            raise invalid(f"cache_salt is {len(cache_salt)} characters, at most {MAX_CACHE_SALT_LEN} allowed")
        message = TokenizeRequest(rid=rid, sampling=params, app=app, arrival=time.time(),
                                  cache_salt=cache_salt, n=n)
        if isinstance(prompt, str):
            if not prompt.strip():
                raise invalid("prompt must not be empty or only whitespace")
            message.prompt = prompt
        elif isinstance(prompt, np.ndarray):
            if not len(prompt):
                raise invalid("prompt_token_ids must not be empty")
            if prompt.min() < 0 or prompt.max() > MAX_TOKEN_ID:
                bad = int(prompt.max()) if prompt.max() > MAX_TOKEN_ID else int(prompt.min())
                raise invalid(f"prompt_token_ids has id {bad}, outside [0, {MAX_TOKEN_ID}]")
            message.prompt_ids = pack_ids(prompt)
        else:
            if not prompt or len(prompt) > MAX_MESSAGES:
                raise invalid(f"messages must hold 1 to {MAX_MESSAGES} messages, got {len(prompt)}")
            for i, m in enumerate(prompt):
                if m.role not in CHAT_ROLES:
                    raise invalid(f"messages[{i}].role is {m.role!r}, not one of {', '.join(CHAT_ROLES)}")
            message.messages = list(prompt)
        if any(r in self.streams or r in self.aborted for r in message.engine_rids()):
            raise Refusal(ErrorCode.ALREADY_EXISTS, f"request_id {rid!r} is already in flight")
        if not self.serving:
            why = self.health.why_not(self.router, self.info, len(self.workers))
            raise Refusal(ErrorCode.UNAVAILABLE, why)
        blocks = self._prefix(prompt, cache_salt) if len(self.router.engines) > 1 else []
        message.engine = self.router.pick(blocks, n)
        return message

    def _prefix(self, prompt: Prompt, cache_salt: str) -> list[bytes]:
        """The request's prefix blocks for affinity routing (gateway/router.py)."""
        if isinstance(prompt, np.ndarray):
            return prefix_blocks(cache_salt, ids=prompt, page=self.info.page_size if self.info else 16)
        if isinstance(prompt, str):
            return prefix_blocks(cache_salt, text=prompt)
        return prefix_blocks(cache_salt, text="".join(f"{m.role}\n{m.content}\n" for m in prompt))

    # ---- tokenizer workers and aborts ------------------------------------------------------
    def _worker(self) -> bytes | None:
        """The next tokenizer worker in turn (None: none connected)."""
        if not self.workers:
            return None
        self._turn = (self._turn + 1) % len(self.workers)
        return self.workers[self._turn]

    def _to_worker(self, worker: bytes, data: bytes) -> bool:
        """Send to one worker now; False when it is gone (it is forgotten until it announces again)."""
        # A non-blocking send completes at once (no send limit); zmq.asyncio reports its error on the
        # future it returns rather than raising.
        sent = self.tokenize.send_multipart([worker, data], flags=zmq.NOBLOCK)
        error = sent.exception() if sent.done() else None  # type: ignore[attr-defined]
        if error is None:
            return True
        if not isinstance(error, zmq.ZMQError) or error.errno != errno.EHOSTUNREACH:
            raise error
        if worker in self.workers:
            self.workers.remove(worker)
            log.warning("tokenizer worker %s is gone", worker.decode(errors="replace"))
        return False

    async def _recv_workers(self) -> None:
        while True:
            worker, data = (await self.tokenize.recv_multipart())[-2:]
            msg = _decode(data, "tokenize")
            if isinstance(msg, WorkerReady) and worker not in self.workers:
                self.workers.append(worker)
                log.info("tokenizer worker %s connected (%d now)", msg.name, len(self.workers))
            elif msg is not None and not isinstance(msg, WorkerReady):
                log.warning("dropped a %s message on the tokenize socket", msg.TAG)

    def _abort(self, streams: list[Stream]) -> None:
        """Abort streams in the engine running them; their ids stay reserved until it confirms. One
        whose output came is held by the engine: straight to it. One still on its way goes through
        the worker that took its add, behind it (straight to the engine if that worker is gone: its
        add went with it, or through already)."""
        expiry = time.monotonic() + ABORTED_HOLD
        direct: dict[int, list[str]] = collections.defaultdict(list)
        queued: dict[tuple[bytes, int], list[str]] = collections.defaultdict(list)
        for stream in streams:
            self.aborted[stream.rid] = expiry
            if stream.started or not stream.worker:
                direct[stream.engine].append(stream.rid)
            else:
                queued[stream.worker, stream.engine].append(stream.rid)
        for (worker, engine), rids in queued.items():
            if not self._to_worker(worker, encode(Abort(rids=rids, engine=engine))):
                direct[engine] += rids
        for engine, rids in direct.items():
            self._abort_in_engine(rids, engine)

    def _abort_in_engine(self, rids: list[str], engine: int) -> None:
        """Abort rids the engine holds on its control socket (only that engine's)."""
        future = self.controls[engine].send(encode(Abort(rids=rids, engine=engine)))
        future.add_done_callback(_log_failure)  # type: ignore[attr-defined]  # pyzmq types it as Awaitable

    def _fail(self, code: ErrorCode, message: str, abort_in_engine: bool,
              which: Callable[[Stream], bool] = lambda s: True) -> None:
        victims = [s for s in self.streams.values() if s.error is None and not s.finish and which(s)]
        for stream in victims:
            stream.fail(code, message, abort_in_engine=False)  # one batched Abort below
        if abort_in_engine:
            self._abort(victims)
        if victims:
            log.warning("%d streams end with %s: %s", len(victims), code.name, message)

    # ---- pipeline input --------------------------------------------------------------------
    async def _recv_deltas(self) -> None:
        turn = time.perf_counter()
        while True:
            data = await self.deltas.recv()
            if len(data) < OFF_LOOP_BYTES:
                msg = _decode(data, "deltas")
            else:  # awaited here: messages are still routed in order
                msg = await asyncio.to_thread(_decode, data, "deltas")
                turn = time.perf_counter()
            if isinstance(msg, TextDeltas):
                self._route(msg)
            elif msg is not None:
                log.warning("dropped a %s message on the deltas socket", msg.TAG)
            # A recv of a queued message completes without yielding, so a backlog would hold the loop
            # (health, metrics, writes) until drained: yield once this turn's budget is spent. Within
            # it, a burst of small deltas lands at once and reaches a slow reader coalesced.
            if time.perf_counter() - turn > TURN_BUDGET:
                await asyncio.sleep(0)
                turn = time.perf_counter()

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
            or any(rows is not None and len(rows) != n
                   for rows in (msg.logprobs_json, msg.prompt_logprobs_json))
            or (msg.embeddings is not None and len(msg.embeddings) != n)
            or (n and msg.offsets[-1] > len(ids))
        ):
            log.warning("dropped a malformed TextDeltas of %d rows", n)
            return
        now = self.health.seen = time.monotonic()
        if msg.stats is not None:
            self.detok_stats.update(msg.stats)
        orphans: list[tuple[int, str]] = []
        for i, rid in enumerate(msg.rids):
            stream = self.streams.get(rid)
            if stream is None or stream.finish or stream.error is not None:
                if msg.finish[i]:
                    self.aborted.pop(rid, None)  # the engine is done with it: the id is free again
                elif stream is None and rid not in self.aborted:
                    # Output nobody reads (its abort was lost with a worker): stop it, in the engine
                    # running it, which holds it.
                    engine = msg.row_engines[i] if msg.row_engines is not None else 0
                    if 0 <= engine < len(self.controls):
                        orphans.append((engine, rid))
                continue
            stream.started = True
            row_ids = ids[msg.offsets[i] : msg.offsets[i + 1]]
            packed = msg.embeddings[i] if msg.embeddings else None
            try:
                embedding = None if packed is None else unpack_floats(packed)
            except MessageError:
                embedding = None
            stream.pending.append(Delta(msg.text[i], row_ids, msg.logprobs[i] if msg.logprobs else None,
                                        msg.prompt_logprobs[i] if msg.prompt_logprobs else None,
                                        msg.logprobs_json[i] if msg.logprobs_json else None,
                                        msg.prompt_logprobs_json[i] if msg.prompt_logprobs_json else None,
                                        embedding))
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
            expiry = time.monotonic() + ABORTED_HOLD
            for engine in sorted({engine for engine, _ in orphans}):
                rids = [rid for where, rid in orphans if where == engine]
                self.aborted.update(dict.fromkeys(rids, expiry))
                self._abort_in_engine(rids, engine)

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
        stream.fail(ErrorCode.parse(msg.code), msg.message, abort_in_engine=False)

    def _on_engine_info(self, msg: EngineInfo) -> None:
        if not 0 <= msg.engine < len(self.router.engines):
            log.warning("dropped a heartbeat of engine %d: this gateway has %d engines (--control)",
                        msg.engine, len(self.router.engines))
            return
        view, index = self.router.engines[msg.engine], msg.engine
        if msg.boot != view.boot:
            if view.boot:  # a new engine: the old one's requests are gone (aborted: see _on_process)
                self._fail(ErrorCode.UNAVAILABLE, f"engine {index} restarted", True,
                           lambda s: on_engine(index)(s) and s.boot != msg.boot)
                self.router.forget(index)
            log.info("engine %d (boot %d) up: %s", index, msg.boot, msg.info)
            view.boot = msg.boot
        self.info = msg.info
        self.metrics.set_context(msg.info.context_length)
        view.seen = time.monotonic()
        view.tensor_parallel_size = msg.tensor_parallel_size
        if msg.stats is not None:
            self.router.report(index, msg.stats)

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
                # (each abort follows its add there). The other engines' requests go on.
                self._fail(ErrorCode.UNAVAILABLE, f"the engine {index} died", abort_in_engine=True,
                           which=on_engine(index))
        elif msg.process in PIPELINE:
            self.health.process(msg.process, msg.up, time.monotonic())
            if not msg.up:
                # Abort them in the engine too: a dead detokenizer leaves them running there.
                self._fail(ErrorCode.UNAVAILABLE, f"the {msg.process} died", abort_in_engine=True)
        elif msg.process.startswith("tokenizer") and not msg.up:
            # Requests queued at the dead worker are lost; the gateway cannot tell which ones (PUSH
            # round-robin), so every request without output yet ends UNAVAILABLE, aborted everywhere.
            self._fail(ErrorCode.UNAVAILABLE, f"{msg.process} died before this request started",
                       abort_in_engine=True, which=lambda s: not s.started)

    # ---- health ----------------------------------------------------------------------------
    async def _update_health(self) -> None:
        async with self._health_lock:  # the monitor and the status receiver both call this
            now = time.monotonic()
            for index, view in enumerate(self.router.engines):
                live = view.is_live(now, self.config.liveness_timeout)
                if live != view.live:
                    log.info("engine %d: %s", index, "serving" if live else "not serving")
                    view.live = live
                    if not live:  # its streams end; the other engines' go on
                        self._fail(ErrorCode.UNAVAILABLE, f"engine {index} stopped responding", True,
                                   on_engine(index))
            healthy = self.health.healthy(self.router, self.info, now, self.config.liveness_timeout,
                                          len(self.workers))
            if healthy != self.serving:
                self.serving = healthy  # admission follows at once, the health services right after
                log.info("health: %s", "SERVING" if healthy else "NOT_SERVING")
                if not healthy:
                    why = self.health.why_not(self.router, self.info, len(self.workers))
                    self._fail(ErrorCode.UNAVAILABLE, why, abort_in_engine=True)
                for listener in self.on_serving:
                    await listener(healthy)

    async def _monitor(self) -> None:
        """Liveness is a matter of time: re-check it, and expire aborted ids, every tick."""
        while True:
            await self._update_health()
            now = time.monotonic()
            for rid in [rid for rid, expiry in self.aborted.items() if expiry < now]:
                del self.aborted[rid]
            await asyncio.sleep(MONITOR_PERIOD)


def on_engine(engine: int) -> Callable[[Stream], bool]:
    """Selects the streams routed to one engine (for _fail)."""
    return lambda stream: stream.engine == engine


def _decode(data: bytes, where: str) -> Message | None:
    try:
        return decode(data)
    except MessageError as exc:
        log.warning("dropped a malformed message on %s: %s", where, exc)
        return None


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("zmq send failed: %s", future.exception())
