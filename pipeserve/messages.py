"""Every message that crosses a ZeroMQ socket, defined once, as typed (nested) dataclasses.

Wire format: a msgpack map {"v": <the type's VERSION>, "t": <type tag>, <fields>...}; a nested
dataclass travels as a map of its fields. Token ids travel as packed little-endian int32 bytes,
never as lists. decode() checks size, version, tag and, recursively, every field's type against the
annotations and raises MessageError on anything malformed, so a receiver can log and drop instead of
crashing. It checks types only: the values were validated once, at the edge that built the message
(the gateway for request shape and sampling parameters, the tokenizer for token-level limits), and
receivers further down trust them. Never pickle.

Sockets (pipeserve.config.Addresses): tokenize (gateway ROUTER <-> tokenizer DEALERs: TokenizeRequest
and Abort to a worker, WorkerReady from it), requests (EngineRequest and Abort, in the order the
gateway sent them through one worker), control (Abort of requests the engine already runs), steps
(StepOutput from the engine, DetokenizeRequest from the tokenizers), deltas (TextDeltas), errors
(RequestError only), status (EngineInfo, ProcessStatus: liveness, process state and the engines'
counters, never a request's outcome).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import msgpack
import numpy as np

from pipeserve.sampling_params import SamplingParams

# 2: nested typed fields (sampling, new, logprobs, info, messages); status socket. 3: detokenizer
# settings from the tokenizer (DetokenizeRequest), aborts through the tokenizers, engine counters only
# on the status socket. 4: a step's logprobs columnar (StepLogprobs).
VERSION = 4
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the largest batched step or request we accept
# Prompt ids a DetokenizeRequest carries: the incremental detokenizer's left context
# (pipeserve.detokenizer.incremental.MAX_CONTEXT is this value).
PROMPT_TAIL = 8
# How the detokenizer hands a request's logprobs to the gateway: "" as TokenLogprob entries (gRPC
# builds its protobufs from them), "completion" or "chat" already rendered as that OpenAI API's JSON
# (LogprobsJSON), which the HTTP front end splices into its responses unchanged.
LOGPROBS_FORMATS = ("", "completion", "chat")


class MessageError(ValueError):
    """A message that cannot be decoded or fails validation."""


def _unpack(data: bytes, dtype: str, what: str) -> np.ndarray[Any, Any]:
    if len(data) % 4:
        raise MessageError(f"packed {what} have {len(data)} bytes, not a multiple of 4")
    return np.frombuffer(data, dtype=dtype)


def pack_ids(ids: Any) -> bytes:
    """Token ids (list, tuple or array) as packed little-endian int32."""
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(data: bytes) -> np.ndarray[Any, np.dtype[np.int32]]:
    return _unpack(data, "<i4", "ids")


def pack_floats(values: Any) -> bytes:
    """float32 values (list or array) as packed little-endian bytes."""
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_floats(data: bytes) -> np.ndarray[Any, np.dtype[np.float32]]:
    return _unpack(data, "<f4", "floats")


M = TypeVar("M", bound="Message")


@dataclass
class Message:
    TAG: ClassVar[str] = ""
    VERSION: ClassVar[int] = VERSION

    @classmethod
    def decode(cls: type[M], data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> M:
        """decode(), and a MessageError unless the message is of this type."""
        msg = decode(data, max_bytes)
        if not isinstance(msg, cls):
            raise MessageError(f"expected a {cls.TAG!r} message, got {msg.TAG!r}")
        return msg


# ---- gateway -> tokenizer -> engine ------------------------------------------------------------


@dataclass
class ChatMessage:
    role: str  # the gateway checked it is one of its chat roles
    content: str
    # OpenAI's function calls of an assistant message ({"id", "type", "function": {"name", "arguments"}})
    # and the call a tool message answers: rendered by the chat template.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


@dataclass
class TokenizeRequest(Message):
    """gateway -> tokenizer: one request, still text (or chat messages, or ids to check). Exactly one
    of prompt, messages, prompt_ids is set; sampling is validated (SamplingParams.validate)."""

    TAG: ClassVar[str] = "tokenize"
    rid: str
    sampling: SamplingParams
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_ids: bytes | None = None
    app: str = ""
    arrival: float = 0.0  # wall clock (time.time()) at the gateway; the engine process converts it
    cache_salt: str = ""  # prefix caching: pages are shared only among requests with the same salt
    n: int = 1  # engine requests made from this one prompt (the OpenAI `n`): see engine_rids()
    fit_max_tokens: bool = False  # max_tokens was not given: lower it to what the context leaves
    engine: int = 0  # data parallel: the engine the gateway routed it to (the tokenizer sends all n there)
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools, for the chat template's `tools`
    logprobs_format: str = ""  # one of LOGPROBS_FORMATS: how its logprobs reach the gateway
    embed: bool = False  # an embedding request: prefill only, answered with the pooled hidden state
    # LoRA: the adapter by name, its id (unique per load) and directory ("" / 0: the base model). The
    # path travels with every request, so an engine reads an adapter when a request first needs it.
    lora_name: str = ""
    lora_id: int = 0
    lora_path: str = ""

    def engine_rids(self) -> list[str]:
        """The ids of the engine requests it becomes: rid, or rid-0 ... rid-(n-1)."""
        return [self.rid] if self.n == 1 else [f"{self.rid}-{i}" for i in range(self.n)]


@dataclass
class EngineRequest(Message):
    """tokenizer -> engine: a request with token ids only, within the model's limits."""

    TAG: ClassVar[str] = "request"
    rid: str
    prompt_ids: bytes
    sampling: SamplingParams
    app: str = ""
    arrival: float = 0.0
    cache_salt: str = ""
    embed: bool = False  # prefill only, no sampling: its one update carries NewRequestInfo.embedding
    lora_name: str = ""  # as TokenizeRequest's
    lora_id: int = 0
    lora_path: str = ""


@dataclass
class Abort(Message):
    """Stop these requests (idempotent; the engine ignores ids it does not hold). The gateway sends
    it through the tokenizer worker that took the add (which forwards it to the engine behind the
    add, so it can never overtake it), or straight to the engine's control socket for a request
    whose output already came; the detokenizer sends it there when a stop string matched."""

    TAG: ClassVar[str] = "abort"
    rids: list[str]
    reason: str = "abort"  # "abort" (client left) or "stop" (stop string matched)
    engine: int = 0  # data parallel: the engine running them (where a tokenizer forwards it)


@dataclass
class WorkerReady(Message):
    """tokenizer -> gateway (tokenize socket), on connecting and every second after: this worker (its
    routing id) takes requests. The gateway sends each request, and later its abort, to one worker."""

    TAG: ClassVar[str] = "ready"
    name: str


# ---- tokenizer -> detokenizer ------------------------------------------------------------------


@dataclass
class DetokenizeRequest(Message):
    """tokenizer -> detokenizer (steps socket), once per tokenized request, beside its add: what
    turning its ids into text needs. The engine never sees these settings."""

    TAG: ClassVar[str] = "detokenize"
    rids: list[str]  # its engine requests (n > 1: one per choice, the same settings)
    prompt_len: int
    prompt_tail: bytes  # the last PROMPT_TAIL prompt ids, packed: the detokenizer's left context
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    logprobs: bool = False  # whether its tokens' logprobs are formatted
    engine: int = 0  # data parallel: the engine running it (its stop abort goes there)
    logprobs_format: str = ""  # one of LOGPROBS_FORMATS (prompt logprobs too)


# ---- engine -> detokenizer ---------------------------------------------------------------------


@dataclass
class PromptLogprobs:
    """Every prompt token's logprob (NaN for the first, which has none) and its top-k alternatives."""

    prompt_ids: bytes  # packed int32 [P]
    logprobs: bytes  # packed float32 [P]
    top_ids: bytes  # packed int32 [P * k], row-major
    top_logprobs: bytes  # packed float32 [P * k]


@dataclass
class NewRequestInfo:
    """What only the engine knows of a request, sent with its first step output."""

    rid: str
    cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache (usage)
    queue_time: float = 0.0  # seconds from its arrival to its first scheduling (metrics)
    prompt_logprobs: PromptLogprobs | None = None  # when the request asked
    embedding: bytes | None = None  # an embedding request's pooled hidden state, packed float32


@dataclass
class StepLogprobs:
    """One step's logprobs, columnar over its rows (one array each, never an object per row): row i's
    sampled token has logprobs[i] and its request's top counts[i] alternatives follow those of the
    rows before it in top_ids / top_logprobs. counts[i] is -1 for a row that did not ask (its logprob
    is NaN); 0 for one that asked for the sampled token's alone."""

    logprobs: bytes  # packed float32 [B]
    counts: bytes  # packed int32 [B]
    top_ids: bytes  # packed int32 [sum of the counts >= 0], row-major
    top_logprobs: bytes  # packed float32 [the same]

    def rows(self, n: int) -> tuple[list[float], list[int], list[int], list[float], list[int]]:
        """Checked columns as lists: each row's logprob and count, every top id and logprob, and
        where each row's top entries start (n + 1 offsets). MessageError if they do not fit n rows."""
        counts = unpack_ids(self.counts)
        lps, top_ids = unpack_floats(self.logprobs), unpack_ids(self.top_ids)
        top_lps = unpack_floats(self.top_logprobs)
        if len(counts) != n or len(lps) != n:
            raise MessageError(f"logprobs of {len(lps)} rows and {len(counts)} counts in a step of {n} rows")
        ends = np.cumsum(np.maximum(counts, 0))
        total = int(ends[-1]) if n else 0
        if len(top_ids) != total or len(top_lps) != total:
            raise MessageError(f"{total} top entries counted, {len(top_ids)} top ids, "
                               f"{len(top_lps)} top logprobs")
        starts = [0, *ends.tolist()]
        return lps.tolist(), counts.tolist(), top_ids.tolist(), top_lps.tolist(), starts


@dataclass
class StepOutput(Message):
    """engine -> detokenizer: ONE message per engine step, columnar over the requests it touched.

    rids[i] got token tokens[i] (-1: no token this step, e.g. aborted before it produced one);
    finish[i] is "" while running, else "stop" | "length" | "abort".
    logprobs, when any request asked: the step's StepLogprobs (rows that did not ask count -1).
    step counts up within one engine's life; a step with rows numbered below the previous one tells
    the detokenizer the engine restarted (it drops the old requests' state). Heartbeats have no rows."""

    TAG: ClassVar[str] = "step"
    step: int
    rids: list[str]
    tokens: bytes
    finish: list[str]
    new: list[NewRequestInfo] = field(default_factory=list)
    logprobs: StepLogprobs | None = None
    engine: int = 0  # data parallel: which engine sent it (its steps count on their own)


# ---- detokenizer -> gateway --------------------------------------------------------------------


@dataclass
class TopLogprob:
    token_id: int
    token: str  # its text as it reads inside running text
    logprob: float


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class LogprobsJSON:
    """Logprob entries rendered as the OpenAI API's JSON by the detokenizer. parts[j]: the
    comma-separated elements of the format's j-th array (completion: tokens, token_logprobs,
    top_logprobs; chat: content); lengths: each entry's token text length in characters, packed
    int32 (one per entry: their count, and completion's text_offset)."""

    parts: list[str]
    lengths: bytes


@dataclass
class TextDeltas(Message):
    """detokenizer -> gateway: every delta produced by one receive, batched.

    Row i: request rids[i] gets text[i] and the ids tokens[offsets[i]:offsets[i+1]]; one row per
    request per message. completion_tokens[i] counts the request's ids so far and
cached_prompt_tokens[i] its prompt tokens found in the prefix cache (usage).
    logprobs, when a row asked: for row i None or one entry per id. stats: the detokenizer's own
    counters ("detok_requests": request states), sent on every receive, heartbeats included (the
    engines' counters reach the gateway only in their EngineInfo heartbeats)."""

    TAG: ClassVar[str] = "deltas"
    rids: list[str]
    text: list[str]
    tokens: bytes
    offsets: list[int]
    finish: list[str]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_prompt_tokens: list[int]
    logprobs: list[list[TokenLogprob] | None] | None = None
    stats: dict[str, int] | None = None
    queue_time: list[float] = field(default_factory=list)  # per row (metrics); empty: not measured
    # With a request's first row, when it asked: one entry per prompt token (the first's logprob NaN).
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None
    row_engines: list[int] | None = None  # data parallel: the engine running each row's request
    # Rows of requests whose logprobs_format is an OpenAI one: their logprobs (and prompt logprobs)
    # here, rendered, instead of in logprobs / prompt_logprobs.
    logprobs_json: list[LogprobsJSON | None] | None = None
    prompt_logprobs_json: list[LogprobsJSON | None] | None = None
    # Per row, when a row is an embedding request's (its only row): the pooled vector, packed float32.
    embeddings: list[bytes | None] | None = None


# ---- errors socket: request failures -----------------------------------------------------------


@dataclass
class RequestError(Message):
    """tokenizer/engine -> gateway: a request failed before producing output."""

    TAG: ClassVar[str] = "error"
    rid: str
    code: str  # a grpc.StatusCode name: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...
    message: str


# ---- status socket: liveness and process state -------------------------------------------------


@dataclass
class ModelInfo:
    """What the engine serves (the gateway's ModelInfo RPC and its admission limits)."""

    name: str
    context_length: int
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: str = ""
    device: str = ""
    backend: str = ""
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    page_size: int = 0
    num_pages: int = 0
    max_logprobs: int = 20
    # The checkpoint's generation_config.json sampling defaults (SamplingParams field -> value): the
    # gateway applies them to the fields a request leaves unset.
    sampling_defaults: dict[str, int | float] = field(default_factory=dict)


@dataclass
class EngineInfo(Message):
    """engine -> gateway (status socket), every heartbeat: what ModelInfo serves, and proof of life.

    boot changes when the engine restarts, so the gateway can fail the requests the old one had."""

    TAG: ClassVar[str] = "engine_info"
    boot: int
    info: ModelInfo
    stats: dict[str, int] | None = None
    engine: int = 0  # data parallel: which engine (its index in the requests/control address lists)
    tensor_parallel_size: int = 1  # ranks this engine runs its model on


@dataclass
class ProcessStatus(Message):
    """supervisor (`pipeserve up`) -> gateway (status socket): a process died or was restarted."""

    TAG: ClassVar[str] = "process"
    process: str  # "engine-0", "detokenizer", "tokenizer-0", ... ("engine": engine 0)
    up: bool


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TAG: cls
    for cls in (TokenizeRequest, EngineRequest, Abort, WorkerReady, DetokenizeRequest, StepOutput, TextDeltas,
                RequestError, EngineInfo, ProcessStatus)
}


# ---- encode / decode ---------------------------------------------------------------------------

_FIELDS: dict[type, tuple[str, ...]] = {}


def _fields_of(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in fields(cls))
    return names


def _as_map(obj: Any) -> dict[str, Any]:
    """msgpack's hook for what it cannot pack itself: a nested dataclass becomes a map of its fields."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {name: _str_keys(getattr(obj, name)) for name in _fields_of(type(obj))}
    raise TypeError(f"cannot put a {type(obj).__name__} on the wire")


def _str_keys(value: Any) -> Any:
    """A map with int keys (SamplingParams.logit_bias) travels with decimal string keys: the decoder
    takes string keys only (msgpack's strict_map_key); _convert turns them back per annotation."""
    if isinstance(value, dict) and value and all(isinstance(k, int) for k in value):
        return {str(k): v for k, v in value.items()}
    return value


def encode(msg: Message) -> bytes:
    body: dict[str, Any] = {"v": msg.VERSION, "t": msg.TAG}
    for name in _fields_of(type(msg)):
        body[name] = getattr(msg, name)
    data: bytes = msgpack.packb(body, use_bin_type=True, default=_as_map)
    return data


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        names = set(_fields_of(cls))
        hints = _HINTS[cls] = {k: v for k, v in typing.get_type_hints(cls).items() if k in names}
    return hints


def _build(cls: type, body: dict[str, Any], where: str) -> Any:
    """A dataclass from a decoded map: every field checked (and converted) against its annotation."""
    hints = _hints(cls)
    kwargs = {}
    for name, hint in hints.items():
        if name in body:
            kwargs[name] = _convert(body[name], hint, f"{where}.{name}")
    unknown = set(body) - set(hints)
    if unknown:
        raise MessageError(f"{where}: unknown fields {sorted(unknown)}")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # missing required fields
        raise MessageError(f"{where}: {exc}") from exc


_SHAPES: dict[Any, tuple[Any, tuple[Any, ...]]] = {}


def _shape(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    """An annotation's origin and arguments, looked up once per annotation (a step's thousands of
    values share a handful)."""
    shape = _SHAPES.get(hint)
    if shape is None:
        shape = _SHAPES[hint] = (typing.get_origin(hint), typing.get_args(hint))
    return shape


def _convert(value: Any, hint: Any, where: str) -> Any:
    """value checked strictly against a dataclass annotation; nested dataclasses are built."""
    origin, args = _shape(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        for option in args:
            try:
                return _convert(value, option, where)
            except MessageError:
                continue
        raise MessageError(f"{where}: unexpected {type(value).__name__}")
    if hint is type(None):
        ok = value is None
    elif hint is Any:
        ok = True
    elif hint is float:
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        ok = isinstance(value, float)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif origin is list:
        if not isinstance(value, list):
            raise MessageError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = args or (Any,)
        if item is Any or (item in (str, bytes) and all(isinstance(v, item) for v in value)):
            return value
        return [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise MessageError(f"{where}: expected a map with string keys, got {type(value).__name__}")
        key, item = args or (str, Any)
        if key is int:
            try:
                value = {int(k): v for k, v in value.items()}
            except ValueError:
                raise MessageError(f"{where}: expected integer keys") from None
        if item is Any:
            return value
        return {k: _convert(v, item, f"{where}.{k}") for k, v in value.items()}
    elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected a map, got {type(value).__name__}")
        return _build(hint, value, where)
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise MessageError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")
    return value


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    if len(data) > max_bytes:
        raise MessageError(f"message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=max_bytes,
                               max_str_len=max_bytes, max_array_len=1 << 20, max_map_len=1 << 16)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MessageError(f"undecodable message: {exc}") from exc
    if not isinstance(body, dict):
        raise MessageError("message is not a map")
    tag = body.pop("t", None)
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {tag!r}")
    version = body.pop("v", None)
    if version != cls.VERSION:
        raise MessageError(f"unsupported {tag} message version {version!r} (this build speaks {cls.VERSION})")
    msg: Message = _build(cls, body, cls.TAG)
    return msg
