"""A tokenizer worker process: a DEALER on the gateway's `tokenize` ROUTER takes TokenizeRequest and
Abort; it PUSHes EngineRequest (token ids only) to the engine, the request's DetokenizeRequest (stop
strings, special tokens, the prompt's tail) to the detokenizer, or RequestError to the gateway.
Stateless: run as many as the load needs; they connect, the gateway, the engine and the
detokenizer bind. A worker announces itself (WorkerReady) on connecting and every second after, so a
restarted gateway learns of it too.

Aborts come through the worker that took the request's add and leave on the same socket to the
engine, after it: ZeroMQ keeps one pipe's order, so an abort never overtakes its add and the engine
needs no memory of aborts for ids it has not seen.

It trusts the gateway's validation (request shape, sampling parameters) and checks only what needs
the tokenizer: prompt length against the context, ids against the vocabulary, the chat template,
and that max_tokens fits in what the context leaves. A structured-output constraint is compiled (and
refused when it does not compile) by the engine, so this process never imports xgrammar or torch."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import zmq

from pipeserve.messages import (
    PROMPT_TAIL,
    Abort,
    ChatMessage,
    DetokenizeRequest,
    EngineRequest,
    MessageError,
    RequestError,
    TokenizeRequest,
    WorkerReady,
    decode,
    encode,
    pack_ids,
    unpack_ids,
)
from pipeserve.tokenizer.load import load_for, model_limits
from pipeserve.tokenizer.process import add_worker_arguments, connect_engines, start_worker, worker_sockets

log = logging.getLogger(__name__)

READY_PERIOD = 1.0  # seconds between two WorkerReady announcements


class InvalidRequest(ValueError):
    """A bad request; the message names the offending field as the client spelled it."""


class Tokenizer:
    """TokenizeRequest -> EngineRequest, socket-free (tests drive it directly)."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = min(len(tokenizer), vocab_size or len(tokenizer))

    def handle(self, req: TokenizeRequest) -> EngineRequest | RequestError:
        try:
            return self.prepare(req)
        except InvalidRequest as exc:
            return RequestError(req.rid, "INVALID_ARGUMENT", str(exc))
        except Exception as exc:  # a tokenizer bug must fail one request, not the worker
            log.exception("tokenizing %s failed", req.rid)
            return RequestError(req.rid, "INTERNAL", f"tokenizer failed: {exc}")

    def handle_all(self, req: TokenizeRequest) -> list[EngineRequest | RequestError]:
        """handle(), once, for every engine request of req (n > 1: the same ids, or the same error,
        under each engine id; a seeded request's copy i samples with seed + i)."""
        out = self.handle(req)
        if req.n == 1:
            return [out]
        if isinstance(out, RequestError):
            return [replace(out, rid=rid) for rid in req.engine_rids()]
        seed = out.sampling.seed
        return [
            replace(out, rid=rid,
                    sampling=replace(out.sampling, seed=None if seed is None else (seed + i) % 2**63))
            for i, rid in enumerate(req.engine_rids())
        ]

    def prepare(self, req: TokenizeRequest) -> EngineRequest:
        """Token ids within the model's limits. The gateway validated the request's shape (one
        non-empty input) and its sampling parameters; what needs the tokenizer is checked here."""
        inputs = [(name, value) for name, value in (("prompt", req.prompt), ("messages", req.messages),
                                                   ("prompt_token_ids", req.prompt_ids)) if value is not None]
        assert len(inputs) == 1, f"the gateway sent {len(inputs)} inputs"
        name = inputs[0][0]
        if req.prompt is not None:
            ids = self.tokenizer.encode(req.prompt)
        elif req.messages is not None:
            ids = self.encode_messages(req.messages, req.tools)
        else:
            ids = self._check_ids(req.prompt_ids or b"")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"{name} is {len(ids)} tokens long, which leaves no room for output in the "
                                 f"context of {self.max_model_len} tokens")
        room = self.max_model_len - len(ids)
        params = req.sampling
        if req.fit_max_tokens and params.max_tokens > room:
            params = replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        if params.max_tokens > room:  # refused, not silently cut short (as vLLM does)
            raise InvalidRequest(f"max_tokens is {params.max_tokens}, but the context is "
                                 f"{self.max_model_len} tokens and {name} takes {len(ids)}: at most {room} "
                                 "can be generated; lower max_tokens")
        # Stop strings are the detokenizer's (DetokenizeRequest): the engine never reads them.
        return EngineRequest(req.rid, pack_ids(ids), replace(params, stop=[]), req.app, req.arrival,
                             req.cache_salt, req.embed, req.lora_name, req.lora_id, req.lora_path)

    @staticmethod
    def detokenize_request(req: TokenizeRequest, add: EngineRequest) -> DetokenizeRequest:
        """What the detokenizer needs of req (tokenized as add), for all its engine requests."""
        ids = unpack_ids(add.prompt_ids)
        params = req.sampling
        return DetokenizeRequest(req.engine_rids(), len(ids), pack_ids(ids[-PROMPT_TAIL:]), list(params.stop),
                                 params.skip_special_tokens, params.logprobs is not None, req.engine,
                                 req.logprobs_format)

    def encode_messages(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None
                        ) -> list[int]:
        """The chat template's rendering of messages (and tools: its `tools` argument), tokenized."""
        if not self.tokenizer.chat_template:
            raise InvalidRequest("messages: this model has no chat template; send a prompt instead")
        chat = [_template_message(m) for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(chat, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as exc:  # jinja errors, including the template's own raise_exception()
            raise InvalidRequest(f"messages: the chat template rejected them: {exc}") from exc
        # The template writes the special tokens (BOS included) itself.
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def _check_ids(self, packed: bytes) -> list[int]:
        try:
            ids = unpack_ids(packed)
        except MessageError as exc:
            raise InvalidRequest(f"prompt_token_ids: {exc}") from exc
        if not len(ids):
            raise InvalidRequest("prompt_token_ids must not be empty")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if len(bad):
            raise InvalidRequest(f"prompt_token_ids: id {int(bad[0])} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        result: list[int] = ids.tolist()
        return result


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: a call's arguments as an object (they iterate or dump
    them), not the JSON text OpenAI sends (arguments that are no JSON object stay text)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            function = dict(call.get("function") or {})
            try:
                arguments = json.loads(function.get("arguments") or "{}")
                if isinstance(arguments, dict):
                    function["arguments"] = arguments
            except (TypeError, json.JSONDecodeError):
                pass
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def serve(worker: Tokenizer, gateway: zmq.Socket[bytes], requests: list[zmq.Socket[bytes]],
          errors: zmq.Socket[bytes], detokenizer: zmq.Socket[bytes], name: str,
          should_stop: Callable[[], bool] = lambda: False) -> None:
    """Until should_stop(): tokenize, tell the detokenizer, then send to the engine the gateway routed
    the request to (requests[i] is connected to engine i); forward aborts behind their adds."""
    ready = encode(WorkerReady(name))
    gateway.send(ready)
    while not should_stop():
        if not gateway.poll(int(READY_PERIOD * 1000)):
            gateway.send(ready)  # idle: say so again (a restarted gateway learns of this worker)
            continue
        try:
            msg = decode(gateway.recv())
        except MessageError as exc:
            log.warning("dropping malformed message: %s", exc)
            continue
        if isinstance(msg, Abort):
            if 0 <= msg.engine < len(requests):
                requests[msg.engine].send(encode(msg))
            continue
        if not isinstance(msg, TokenizeRequest):
            log.warning("dropping malformed message: a %s is no request", msg.TAG)
            continue
        outs = worker.handle_all(msg)
        if isinstance(outs[0], EngineRequest):  # before the adds: its output finds it there
            detokenizer.send(encode(worker.detokenize_request(msg, outs[0])))
        # All n copies go to the one engine the gateway chose, so they share its prefix cache.
        for out in outs:
            log.debug("tokenized %s: %s", out.rid, out.TAG)
            (requests[msg.engine] if isinstance(out, EngineRequest) else errors).send(encode(out))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # --max-model-len: give the engine's value when it serves a shorter context than the model's.
    add_worker_arguments(parser, {"tokenize": "connect: requests and aborts from the gateway",
                                  "requests": "connect: token ids and aborts to the engine (data parallel: "
                                              "one endpoint per engine, comma-separated)",
                                  "steps": "connect: each request's detokenizer settings",
                                  "errors": "connect: rejections to the gateway"})


def main(args: argparse.Namespace) -> int:
    model_dir, tokenizer = load_for(start_worker(args, "tokenizer"))
    limits = model_limits(model_dir, args.rope_scaling)
    max_model_len = min(args.max_model_len or limits.context_len, limits.context_len)
    worker = Tokenizer(tokenizer, max_model_len, limits.vocab_size)
    name = f"tokenizer@{socket.gethostname()}:{os.getpid()}"
    with worker_sockets("tokenizer") as internal:
        ctx = internal.ctx
        gateway, errors, detokenizer = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
        gateway.setsockopt(zmq.ROUTING_ID, name.encode())
        requests = connect_engines(internal, args.requests)
        internal.connect(gateway, args.tokenize)
        internal.connect(errors, args.errors)
        internal.connect(detokenizer, args.steps)
        log.info("ready (pid %d): %s -> %s, context %d", os.getpid(), args.tokenize, args.requests,
                 max_model_len)
        serve(worker, gateway, requests, errors, detokenizer, name)
    return 0
