"""Every message that crosses a ZeroMQ socket, defined once.

Wire format: a msgpack map {"v": VERSION, "t": <type tag>, <fields>...}. Token ids travel as packed
little-endian int32 bytes, never as lists. decode() checks size, version, tag and every field's type
and raises MessageError on anything malformed, so a receiver can log and drop instead of crashing.
Never pickle.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack
import numpy as np

VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the largest batched step or request we accept


class MessageError(ValueError):
    """A message that cannot be decoded or fails validation."""


def pack_ids(ids: Any) -> bytes:
    """Token ids (list, tuple or array) as packed little-endian int32."""
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise MessageError(f"packed ids have {len(data)} bytes, not a multiple of 4")
    return np.frombuffer(data, dtype="<i4")


@dataclass
class Message:
    TAG: ClassVar[str] = ""


@dataclass
class TokenizeRequest(Message):
    """gateway -> tokenizer: one request, still text (or chat messages, or ids to check)."""

    TAG: ClassVar[str] = "tokenize"
    rid: str
    sampling: dict[str, Any]
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_ids: bytes | None = None
    app: str = ""
    arrival: float = 0.0


@dataclass
class EngineRequest(Message):
    """tokenizer -> engine: a request with token ids only."""

    TAG: ClassVar[str] = "request"
    rid: str
    prompt_ids: bytes
    sampling: dict[str, Any]
    app: str = ""
    arrival: float = 0.0


@dataclass
class Abort(Message):
    """gateway/detokenizer -> engine: stop these requests (idempotent; may overtake the add)."""

    TAG: ClassVar[str] = "abort"
    rids: list[str]
    reason: str = "abort"  # "abort" (client left) or "stop" (stop string matched)


@dataclass
class NewRequestInfo:
    """What the detokenizer needs to know of a request, sent with its first step output."""

    rid: str
    prompt_len: int
    prompt_tail: bytes  # last few prompt ids, packed: the incremental detokenizer's left context
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    logprobs: int | None = None


@dataclass
class StepOutput(Message):
    """engine -> detokenizer: ONE message per engine step, columnar over the requests it touched.

    rids[i] got token tokens[i] (-1: no token this step, e.g. aborted before it produced one);
    finish[i] is "" while running, else "stop" | "length" | "abort".
    logprobs, when any request asked: for row i either None or
    [sampled_logprob, packed top ids, packed float32 top logprobs].
    step counts up within one engine's life; a step with rows numbered below the previous one tells
    the detokenizer the engine restarted (it drops the old requests' state). Heartbeats have no rows."""

    TAG: ClassVar[str] = "step"
    step: int
    rids: list[str]
    tokens: bytes
    finish: list[str]
    new: list[dict[str, Any]] = field(default_factory=list)  # NewRequestInfo as dicts
    logprobs: list[Any] | None = None
    # Engine counters piggy-backed for the gateway's /stats and the tests (running, waiting, pages).
    stats: dict[str, int] | None = None


@dataclass
class TextDeltas(Message):
    """detokenizer -> gateway: every delta produced by one receive, batched.

    Row i: request rids[i] gets text[i] and the ids tokens[offsets[i]:offsets[i+1]]; one row per
    request per message. completion_tokens[i] counts the request's ids so far (usage).
    logprobs, when a row asked: for row i None or one entry per id, {"token_id", "token" (its text),
    "logprob", "top": [{"token_id", "token", "logprob"}, ...]}. stats: the engine's latest counters
    plus "detok_requests" (live detokenizer states); sent on every receive, heartbeats included."""

    TAG: ClassVar[str] = "deltas"
    rids: list[str]
    text: list[str]
    tokens: bytes
    offsets: list[int]
    finish: list[str]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    logprobs: list[Any] | None = None
    stats: dict[str, int] | None = None


@dataclass
class RequestError(Message):
    """tokenizer/engine -> gateway: a request failed before producing output."""

    TAG: ClassVar[str] = "error"
    rid: str
    code: str  # a grpc.StatusCode name: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...
    message: str


@dataclass
class EngineInfo(Message):
    """engine -> gateway (errors socket), every heartbeat: what ModelInfo serves, and proof of life.

    boot changes when the engine restarts, so the gateway can fail the requests the old one had."""

    TAG: ClassVar[str] = "engine_info"
    boot: int
    info: dict[str, Any]  # Engine.model_info() plus max_logprobs
    stats: dict[str, int] | None = None


@dataclass
class ProcessStatus(Message):
    """supervisor (`pipeserve up`) -> gateway (errors socket): a process died or was restarted."""

    TAG: ClassVar[str] = "process"
    process: str  # "engine", "detokenizer", "tokenizer-0", ...
    up: bool


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TAG: cls
    for cls in (TokenizeRequest, EngineRequest, Abort, StepOutput, TextDeltas, RequestError, EngineInfo,
                ProcessStatus)
}


def new_request_info(data: dict[str, Any]) -> NewRequestInfo:
    """Validate one StepOutput.new entry (decode() only checks that it is a map)."""
    hints = _HINTS.get(NewRequestInfo)
    if hints is None:
        hints = _HINTS[NewRequestInfo] = typing.get_type_hints(NewRequestInfo)
    unknown = set(data) - set(hints)
    if unknown:
        raise MessageError(f"new: unknown fields {sorted(unknown)}")
    for name, value in data.items():
        _check(value, hints[name], f"new.{name}")
    try:
        return NewRequestInfo(**data)
    except TypeError as exc:  # missing required fields
        raise MessageError(f"new: {exc}") from exc


def encode(msg: Message) -> bytes:
    body: dict[str, Any] = {"v": VERSION, "t": msg.TAG}
    for f in fields(msg):
        body[f.name] = getattr(msg, f.name)
    return msgpack.packb(body, use_bin_type=True)


def _check(value: Any, hint: Any, where: str) -> None:
    """Strict, shallow type check of a decoded value against a dataclass annotation."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        for option in typing.get_args(hint):
            try:
                _check(value, option, where)
                return
            except MessageError:
                continue
        raise MessageError(f"{where}: unexpected {type(value).__name__}")
    if hint is type(None):
        ok = value is None
    elif hint is Any:
        ok = True
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif origin is list:
        ok = isinstance(value, list)
        if ok and typing.get_args(hint) and typing.get_args(hint)[0] is not Any:
            for i, item in enumerate(value):
                _check(item, typing.get_args(hint)[0], f"{where}[{i}]")
    elif origin is dict:
        ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise MessageError(f"{where}: expected {hint}, got {type(value).__name__}")


_HINTS: dict[type, dict[str, Any]] = {}


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
    if body.get("v") != VERSION:
        raise MessageError(f"unsupported message version {body.get('v')!r}")
    cls = MESSAGE_TYPES.get(body.get("t"))  # type: ignore[arg-type]
    if cls is None:
        raise MessageError(f"unknown message type {body.get('t')!r}")
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = {k: v for k, v in typing.get_type_hints(cls).items() if k != "TAG"}
    kwargs = {}
    for name, hint in hints.items():
        if name in body:
            _check(body[name], hint, f"{cls.TAG}.{name}")
            kwargs[name] = body[name]
    unknown = set(body) - set(hints) - {"v", "t"}
    if unknown:
        raise MessageError(f"{cls.TAG}: unknown fields {sorted(unknown)}")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # missing required fields
        raise MessageError(f"{cls.TAG}: {exc}") from exc
