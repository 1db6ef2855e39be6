"""The detokenizer process: PULL StepOutput from the engine (binds `steps`), PUSH one TextDeltas per
receive to the gateway (`deltas`) and Abort to the engine (`control`) when a stop string matches.

Each receive drains what is queued, so a slow moment costs one bigger message, not a backlog.
Per-request state comes from the NewRequestInfo in the request's first step and is dropped when
the request finishes; rows of requests without state (already stopped, or from before a restart)
are dropped."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from typing import Any

import zmq

from pipeserve.detokenizer.incremental import IncrementalDetokenizer, RequestText, make_decoder, skipped_ids
from pipeserve.detokenizer.logprobs import TokenTexts, format_logprobs, format_prompt_logprobs
from pipeserve.messages import (
    Abort,
    MessageError,
    NewRequestInfo,
    StepOutput,
    TextDeltas,
    TokenLogprob,
    encode,
    pack_ids,
    unpack_ids,
)
from pipeserve.tokenizer.load import (
    add_worker_arguments,
    connect_engines,
    load_for,
    start_worker,
    worker_sockets,
)

log = logging.getLogger(__name__)

MAX_DRAIN = 256  # step messages folded into one TextDeltas


@dataclass
class RequestState:
    text: RequestText
    prompt_tokens: int
    logprobs: bool
    cached_prompt_tokens: int = 0
    queue_time: float = 0.0
    prompt_logprobs: list[TokenLogprob] | None = None  # sent with the request's first row
    engine: int = 0  # data parallel: the engine running it (its stop abort goes there)


@dataclass
class Row:
    """One request's output over one receive (possibly several engine steps)."""

    state: RequestState
    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish: str = ""
    prompt_logprobs: list[TokenLogprob] | None = None


class Detokenizer:
    """Request state and the StepOutput -> TextDeltas logic, socket-free (tests drive it directly)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decode = make_decoder(tokenizer)
        self._skip = skipped_ids(tokenizer)
        self.texts = TokenTexts(tokenizer)
        self.requests: dict[str, RequestState] = {}
        self.last_step: dict[int, int] = {}  # engine -> its latest step (each engine counts its own)
        self.engine_stats: dict[int, dict[str, int]] = {}

    def process(self, step: StepOutput, rows: dict[str, Row]) -> list[tuple[int, str]]:
        """Fold one step into rows (by rid); returns (engine, rid) of the requests a stop string ended
        while running."""
        tokens = unpack_ids(step.tokens)
        n = len(step.rids)
        lp_rows = n if step.logprobs is None else len(step.logprobs)
        if len(tokens) != n or len(step.finish) != n or lp_rows != n:
            raise MessageError(f"step {step.step}: {n} rids, {len(tokens)} tokens, {len(step.finish)} finish")
        if step.stats is not None:
            self.engine_stats[step.engine] = step.stats
        if n or step.new:
            last = self.last_step.get(step.engine, -1)
            if step.step < last:
                lost = [rid for rid, state in self.requests.items() if state.engine == step.engine]
                log.warning("engine %d restarted (step %d after %d): dropping %d requests", step.engine,
                            step.step, last, len(lost))
                for rid in lost:
                    del self.requests[rid]
            self.last_step[step.engine] = step.step
        for info in step.new:
            self._start(info, step.engine)
        stopped = []
        for i, rid in enumerate(step.rids):
            state = self.requests.get(rid)
            if state is None:
                continue
            row = rows.get(rid)
            if row is None or row.state is not state:
                row = rows[rid] = Row(state, prompt_logprobs=state.prompt_logprobs)
                state.prompt_logprobs = None
            token = int(tokens[i])
            ids = [token] if token >= 0 else []
            if ids:
                row.tokens.append(token)
                lp = step.logprobs[i] if step.logprobs is not None else None
                if state.logprobs and lp is not None:
                    try:
                        entry = format_logprobs(token, lp, self.texts)
                        row.logprobs = row.logprobs if row.logprobs is not None else []
                        row.logprobs.append(entry)
                    except MessageError as exc:
                        log.warning("dropping malformed logprobs of %s: %s", rid, exc)
            update = state.text.feed(ids, step.finish[i])
            row.text.append(update.text)
            if update.abort:
                stopped.append((state.engine, rid))
            if update.finish:
                row.finish = update.finish
                del self.requests[rid]
        return stopped

    def _start(self, info: NewRequestInfo, engine: int) -> None:
        try:
            tail = unpack_ids(info.prompt_tail)
        except MessageError as exc:
            log.warning("dropping malformed NewRequestInfo: %s", exc)
            return
        if info.rid in self.requests:
            return  # announced again (e.g. after preemption): keep the text state
        detok = IncrementalDetokenizer(self.tokenizer, tail.tolist(), info.stop, info.skip_special_tokens,
                                       decode=self._decode, skip=self._skip)
        prompt = None
        if info.prompt_logprobs is not None:
            try:
                prompt = format_prompt_logprobs(info.prompt_logprobs, self.texts)
            except MessageError as exc:
                log.warning("dropping malformed prompt logprobs of %s: %s", info.rid, exc)
        self.requests[info.rid] = RequestState(RequestText(detok), info.prompt_len, info.logprobs is not None,
                                               info.cached_prompt_tokens, info.queue_time, prompt, engine)

    def deltas(self, rows: dict[str, Row]) -> TextDeltas:
        offsets, tokens = [0], []
        for row in rows.values():
            tokens += row.tokens
            offsets.append(len(tokens))
        logprobs = [row.logprobs for row in rows.values()]
        prompt = [row.prompt_logprobs for row in rows.values()]
        return TextDeltas(
            rids=list(rows), text=["".join(row.text) for row in rows.values()], tokens=pack_ids(tokens),
            offsets=offsets, finish=[row.finish for row in rows.values()],
            prompt_tokens=[row.state.prompt_tokens for row in rows.values()],
            cached_prompt_tokens=[row.state.cached_prompt_tokens for row in rows.values()],
            completion_tokens=[row.state.text.completion_tokens for row in rows.values()],
            logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
            stats={"detok_requests": len(self.requests)},
            queue_time=[row.state.queue_time for row in rows.values()],
            prompt_logprobs=prompt if any(lp is not None for lp in prompt) else None,
            row_engines=[row.state.engine for row in rows.values()],
            engines={str(engine): stats for engine, stats in self.engine_stats.items()})


def serve(
    detok: Detokenizer, steps: zmq.Socket[bytes], deltas: zmq.Socket[bytes], control: list[zmq.Socket[bytes]]
) -> None:
    """Forever: block for a step, drain the queue, send one TextDeltas (and one Abort if needed)."""
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
                stopped += detok.process(StepOutput.decode(frame), rows)
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
    add_worker_arguments(parser, {"steps": "bind: step outputs from the engine",
                                  "deltas": "connect: text deltas to the gateway",
                                  "control": "connect: stop aborts to the engine (data parallel: one "
                                             "endpoint per engine, comma-separated)"})


def main(args: argparse.Namespace) -> int:
    detok = Detokenizer(load_for(start_worker(args, "detokenizer"))[1])
    with worker_sockets() as ctx:
        steps, deltas = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        control = connect_engines(ctx, args.control)
        steps.bind(args.steps)
        deltas.connect(args.deltas)
        log.info("ready: steps %s -> deltas %s, aborts -> %s", args.steps, args.deltas, args.control)
        serve(detok, steps, deltas, control)
    return 0
