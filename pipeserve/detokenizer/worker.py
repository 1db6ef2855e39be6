"""The detokenizer process: PULL StepOutput from the engine and DetokenizeRequest from the tokenizers
(binds `steps`), PUSH one TextDeltas per receive to the gateway (`deltas`) and Abort to the engine
(`control`) when a stop string matches.

Each receive drains what is queued, so a slow moment costs one bigger message, not a backlog.
A request's state starts with its DetokenizeRequest (its stop strings, special tokens and prompt
tail, from the tokenizer that sent its add), takes what only the engine knows (prefix-cache hits,
queue time, prompt logprobs) from the NewRequestInfo in its first step, and is dropped when the
request finishes. The tokenizer sends the settings before the add, so they come first; should a
request's first step still arrive before them (two pipes, no order between them), its rows wait
for them. Rows of requests without state (already stopped, or from before a restart) are dropped."""

from __future__ import annotations

import argparse
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from pipeserve.detokenizer.incremental import IncrementalDetokenizer, RequestText, make_decoder, skipped_ids
from pipeserve.detokenizer.logprobs import (
    RowLogprobs,
    TokenTexts,
    format_logprobs,
    format_prompt_logprobs,
    prompt_rows,
)
from pipeserve.detokenizer.openai_logprobs import Pieces, Renderer
from pipeserve.messages import (
    LOGPROBS_FORMATS,
    Abort,
    DetokenizeRequest,
    LogprobsJSON,
    MessageError,
    NewRequestInfo,
    PromptLogprobs,
    StepOutput,
    TextDeltas,
    TokenLogprob,
    decode,
    encode,
    pack_ids,
    unpack_ids,
)
from pipeserve.tokenizer.load import load_for
from pipeserve.tokenizer.process import add_worker_arguments, connect_engines, start_worker, worker_sockets

log = logging.getLogger(__name__)

MAX_DRAIN = 256  # messages folded into one TextDeltas
MAX_REQUESTS = 1 << 18  # request states kept; beyond, the oldest go (bounds what lost requests leave)
MAX_EARLY = 4096  # requests whose first step came before their settings, held until those come


@dataclass
class RequestState:
    text: RequestText
    prompt_tokens: int
    logprobs: bool
    engine: int = 0  # data parallel: the engine running it (its stop abort goes there)
    started: bool = False  # the engine reported it (its first step came)
    cached_prompt_tokens: int = 0
    queue_time: float = 0.0
    prompt_logprobs: list[TokenLogprob] | None = None  # sent with the request's first row
    logprobs_format: str = ""  # "": TokenLogprob entries; else rendered as that OpenAI format's JSON
    prompt_logprobs_json: LogprobsJSON | None = None  # sent with the request's first row
    embedding: bytes | None = None  # an embedding request's vector, passed on with its (only) row


@dataclass
class Early:
    """A request whose first step came before its settings: what the engine said, held."""

    info: NewRequestInfo
    steps: list[tuple[int, str, RowLogprobs | None]] = field(default_factory=list)  # token, finish, logprobs


@dataclass
class Row:
    """One request's output over one receive (possibly several engine steps)."""

    state: RequestState
    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish: str = ""
    prompt_logprobs: list[TokenLogprob] | None = None
    logprobs_json: Pieces | None = None
    prompt_logprobs_json: LogprobsJSON | None = None
    embedding: bytes | None = None


class Detokenizer:
    """Request state and the StepOutput -> TextDeltas logic, socket-free (tests drive it directly)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decode = make_decoder(tokenizer)
        self._skip = skipped_ids(tokenizer)
        self.texts = TokenTexts(tokenizer)
        self.renderer = Renderer(self.texts)
        self.more_stats: Callable[[], dict[str, int]] = dict  # the process's own counters (zmq_auth)
        self.requests: OrderedDict[str, RequestState] = OrderedDict()
        self.early: OrderedDict[str, Early] = OrderedDict()
        # Queued requests of a dead engine, dropped: output for them is ignored, never held as early.
        self.gone: OrderedDict[str, None] = OrderedDict()
        self.last_step: dict[int, int] = {}  # engine -> its latest step (each engine counts its own)

    def handle(self, msg: DetokenizeRequest | StepOutput, rows: dict[str, Row]) -> list[tuple[int, str]]:
        """Fold one message into rows (by rid); returns (engine, rid) of the requests a stop string
        ended while running."""
        return self.settings(msg, rows) if isinstance(msg, DetokenizeRequest) else self.process(msg, rows)

    def settings(self, msg: DetokenizeRequest, rows: dict[str, Row]) -> list[tuple[int, str]]:
        """A request's settings: its state starts (and output that came before them is fed)."""
        try:
            tail = unpack_ids(msg.prompt_tail).tolist()
        except MessageError as exc:
            log.warning("dropping a malformed DetokenizeRequest: %s", exc)
            return []
        if msg.logprobs_format not in LOGPROBS_FORMATS:
            log.warning("unknown logprobs format %r of %s: sending its logprobs as entries",
                        msg.logprobs_format, msg.rids[:1])
            msg.logprobs_format = ""
        stopped = []
        for rid in msg.rids:
            if rid in self.requests:
                continue
            detok = IncrementalDetokenizer(self.tokenizer, tail, msg.stop, msg.skip_special_tokens,
                                           decode=self._decode, skip=self._skip)
            state = self.requests[rid] = RequestState(RequestText(detok), msg.prompt_len, msg.logprobs,
                                                      msg.engine, logprobs_format=msg.logprobs_format)
            early = self.early.pop(rid, None)
            if early is not None:
                self._started(state, early.info)
                for token, finish, lp in early.steps:
                    if self._feed(rid, state, token, finish, lp, rows):
                        stopped.append((state.engine, rid))
        while len(self.requests) > MAX_REQUESTS:
            rid, _ = self.requests.popitem(last=False)
            log.warning("over %d request states: dropped the oldest, %s", MAX_REQUESTS, rid)
        return stopped

    def process(self, step: StepOutput, rows: dict[str, Row]) -> list[tuple[int, str]]:
        """Fold one step into rows (by rid)."""
        tokens = unpack_ids(step.tokens).tolist()
        n = len(step.rids)
        if len(tokens) != n or len(step.finish) != n:
            raise MessageError(f"step {step.step}: {n} rids, {len(tokens)} tokens, {len(step.finish)} finish")
        counts: list[int] = []  # each row's top count (-1: no logprobs), empty when the step has none
        if step.logprobs is not None:
            try:
                lps, counts, top_ids, top_lps, starts = step.logprobs.rows(n)
            except MessageError as exc:  # the tokens stand without them
                log.warning("dropping the malformed logprobs of step %d: %s", step.step, exc)
        # Every step counts, the idle heartbeat too: a new engine sends one as it comes up, before the
        # gateway routes it anything, so the states of that engine held now are all its predecessor's.
        last = self.last_step.get(step.engine, -1)
        if step.step < last:  # a new engine: its predecessor's requests are gone, started or queued
            coming = {info.rid for info in step.new}  # already this engine's (adds queued during the restart)
            lost = [rid for rid, state in self.requests.items()
                    if state.engine == step.engine and rid not in coming]
            log.warning("engine %d restarted (step %d after %d): dropping %d requests", step.engine,
                        step.step, last, len(lost))
            for rid in lost:
                if not self.requests.pop(rid).started:
                    # Its add may still reach the new engine, behind it the gateway's abort: that
                    # finish must not wait for settings that came and went.
                    self.gone[rid] = None
            while len(self.gone) > MAX_EARLY:
                self.gone.popitem(last=False)
        self.last_step[step.engine] = step.step
        for info in step.new:
            state = self.requests.get(info.rid)
            if state is not None:
                self._started(state, info)
            elif info.rid in self.gone:
                continue
            elif len(self.early) < MAX_EARLY:
                self.early[info.rid] = Early(info)
            else:
                log.warning("dropping %s: over %d requests wait for their settings", info.rid, MAX_EARLY)
        stopped = []
        for i, rid in enumerate(step.rids):
            lp: RowLogprobs | None = None
            if counts and counts[i] >= 0:
                lp = (lps[i], top_ids[starts[i]:starts[i + 1]], top_lps[starts[i]:starts[i + 1]])
            state = self.requests.get(rid)
            if state is None:
                early = self.early.get(rid)
                if early is not None:
                    early.steps.append((tokens[i], step.finish[i], lp))
                elif step.finish[i]:
                    self.gone.pop(rid, None)
                continue
            if self._feed(rid, state, tokens[i], step.finish[i], lp, rows):
                stopped.append((state.engine, rid))
        return stopped

    def _started(self, state: RequestState, info: NewRequestInfo) -> None:
        if state.started:
            return  # announced again (e.g. after preemption): keep what came first
        state.started = True
        state.cached_prompt_tokens, state.queue_time = info.cached_prompt_tokens, info.queue_time
        state.embedding = info.embedding
        if info.prompt_logprobs is not None:
            try:
                fmt = state.logprobs_format
                if fmt:
                    state.prompt_logprobs_json = self._render_prompt(info.prompt_logprobs, fmt)
                else:
                    state.prompt_logprobs = format_prompt_logprobs(info.prompt_logprobs, self.texts)
            except MessageError as exc:
                log.warning("dropping malformed prompt logprobs of %s: %s", info.rid, exc)

    def _feed(self, rid: str, state: RequestState, token: int, finish: str, lp: RowLogprobs | None,
              rows: dict[str, Row]) -> bool:
        """One step's token (-1: none) and finish of a request into its row; whether a stop string
        ended it while it runs (the engine must be told)."""
        state.started = True
        row = rows.get(rid)
        if row is None or row.state is not state:
            row = rows[rid] = Row(state, prompt_logprobs=state.prompt_logprobs,
                                  prompt_logprobs_json=state.prompt_logprobs_json, embedding=state.embedding)
            state.prompt_logprobs, state.prompt_logprobs_json, state.embedding = None, None, None
        ids = [token] if token >= 0 else []
        if ids:
            row.tokens.append(token)
            if state.logprobs and lp is not None:
                if state.logprobs_format:
                    if row.logprobs_json is None:
                        row.logprobs_json = self.renderer.pieces(state.logprobs_format)
                    self.renderer.add(row.logprobs_json, state.logprobs_format, token, *lp)
                else:
                    row.logprobs = row.logprobs if row.logprobs is not None else []
                    row.logprobs.append(format_logprobs(token, *lp, self.texts))
        update = state.text.feed(ids, finish)
        row.text.append(update.text)
        if update.finish:
            row.finish = update.finish
            del self.requests[rid]
        return update.abort

    def _render_prompt(self, prompt: PromptLogprobs, fmt: str) -> LogprobsJSON:
        """Prompt logprobs rendered (the first token has none: NaN, no top)."""
        pieces = self.renderer.pieces(fmt)
        for entry in prompt_rows(prompt):
            self.renderer.add(pieces, fmt, *entry)
        return pieces.message()

    def deltas(self, rows: dict[str, Row]) -> TextDeltas:
        offsets, tokens = [0], []
        for row in rows.values():
            tokens += row.tokens
            offsets.append(len(tokens))
        logprobs = [row.logprobs for row in rows.values()]
        prompt = [row.prompt_logprobs for row in rows.values()]
        rendered = [row.logprobs_json.message() if row.logprobs_json is not None else None
                    for row in rows.values()]
        prompt_rendered = [row.prompt_logprobs_json for row in rows.values()]
        embeddings = [row.embedding for row in rows.values()]
        return TextDeltas(
            rids=list(rows), text=["".join(row.text) for row in rows.values()], tokens=pack_ids(tokens),
            offsets=offsets, finish=[row.finish for row in rows.values()],
            prompt_tokens=[row.state.prompt_tokens for row in rows.values()],
            cached_prompt_tokens=[row.state.cached_prompt_tokens for row in rows.values()],
            completion_tokens=[row.state.text.completion_tokens for row in rows.values()],
            logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
            stats={"detok_requests": len(self.requests)} | self.more_stats(),
            queue_time=[row.state.queue_time for row in rows.values()],
            prompt_logprobs=prompt if any(lp is not None for lp in prompt) else None,
            row_engines=[row.state.engine for row in rows.values()],
            logprobs_json=rendered if any(lp is not None for lp in rendered) else None,
            prompt_logprobs_json=prompt_rendered if any(lp is not None for lp in prompt_rendered) else None,
            embeddings=embeddings if any(e is not None for e in embeddings) else None)


def serve(
    detok: Detokenizer, steps: zmq.Socket[bytes], deltas: zmq.Socket[bytes], control: list[zmq.Socket[bytes]]
) -> None:
    """Forever: block for a message, drain the queue, send one TextDeltas (and one Abort if needed)."""
    while True:
        frames = [steps.recv()]
        while len(frames) < MAX_DRAIN:
            try:
                frames.append(steps.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        rows: dict[str, Row] = {}
        stopped: list[tuple[int, str]] = []
        for frame in frames:
            try:
                msg = decode(frame)
                if not isinstance(msg, (StepOutput, DetokenizeRequest)):
                    raise MessageError(f"a {msg.TAG} message on the steps socket")
                stopped += detok.handle(msg, rows)
            except MessageError as exc:
                log.warning("dropping malformed message: %s", exc)
            except Exception:  # a bug on one message must not take the pipeline down
                log.exception("failed to process a step output; dropped")
        for engine, sock in enumerate(control):
            rids = [rid for where, rid in stopped if where == engine]
            if rids:
                sock.send(encode(Abort(rids, reason="stop")))
        deltas.send(encode(detok.deltas(rows)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser, {"steps": "bind: step outputs from the engine, request settings from the "
                                           "tokenizers",
                                  "deltas": "connect: text deltas to the gateway",
                                  "control": "connect: stop aborts to the engine (data parallel: one "
                                             "endpoint per engine, comma-separated)"})


def main(args: argparse.Namespace) -> int:
    detok = Detokenizer(load_for(start_worker(args, "detokenizer"))[1])
    with worker_sockets("detokenizer") as internal:
        steps, deltas = internal.ctx.socket(zmq.PULL), internal.ctx.socket(zmq.PUSH)
        control = connect_engines(internal, args.control)
        internal.bind(steps, args.steps)
        internal.connect(deltas, args.deltas)
        detok.more_stats = internal.stats
        log.info("ready: steps %s -> deltas %s, aborts -> %s", args.steps, args.deltas, args.control)
        serve(detok, steps, deltas, control)
    return 0
