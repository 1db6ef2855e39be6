"""The engine process (`pipeserve engine`): the loop that wraps the Engine core in sockets.

Binds `requests` (PULL EngineRequest and Abort from the tokenizers) and `control` (PULL Abort from
the gateway and the detokenizer), connects `steps` (PUSH StepOutput to the detokenizer), `errors`
(PUSH RequestError to the gateway) and `status` (PUSH EngineInfo to the gateway). It binds only
once the model is loaded, so an open port means ready.

Between two steps it drains everything queued on both inputs without blocking (a blocking poll
only when idle, woken by input or the heartbeat) and applies it in order: the requests socket's
adds and aborts as they came (an abort travels behind its add, through the tokenizer that took the
add), then the control socket's aborts (of requests whose output already came, so the engine holds
them). An abort for an id the engine does not hold is of a request already finished: ignored. This
loop owns everything the Engine core leaves out: the wire format (each step's updates become ONE
columnar StepOutput) and the clocks (the gateway's wall-clock arrival becomes monotonic here).
Idle, it sends an empty StepOutput every heartbeat (the detokenizer passes one on, proving the path
alive); always, an EngineInfo (ModelInfo's data, the engine's counters; the boot id tells the
gateway of a restart): the one channel its counters take.

Requests arrive validated (gateway: shape and sampling parameters; tokenizer: token-level limits),
so a request the Engine's assertions reject is a bug upstream: it fails that request, INTERNAL.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from pipeserve import config as cfg
from pipeserve.config import Addresses, EngineConfig, InternalAuth, engine_endpoint
from pipeserve.engine.sequence import StepUpdate, TokenLogprobs, one_token_updates
from pipeserve.lora import LoRAError, LoRARequest
from pipeserve.messages import (
    MAX_MESSAGE_BYTES,
    Abort,
    EngineInfo,
    EngineRequest,
    Message,
    MessageError,
    ModelInfo,
    NewRequestInfo,
    PromptLogprobs,
    RequestError,
    StepLogprobs,
    StepOutput,
    decode,
    encode,
    pack_floats,
    pack_ids,
    unpack_ids,
)
from pipeserve.startup import fail, phase
from pipeserve.zmq_auth import InternalSockets

log = logging.getLogger("pipeserve.engine")

HEARTBEAT = 0.5  # seconds
MAX_DRAIN = 4096  # messages taken from one socket between two steps (bounded so steps keep coming)


def step_output(step: int, updates: list[StepUpdate], engine: int = 0) -> StepOutput:
    """The wire form of one step's updates: columns, packed ids, NewRequestInfo for new requests."""
    updates = one_token_updates(updates)
    new = []
    for u in updates:
        if u.new:
            seq = u.seq
            queued = (seq.first_scheduled or seq.arrival) - seq.arrival
            prompt = None
            if u.prompt_logprobs is not None:
                lp = u.prompt_logprobs
                prompt = PromptLogprobs(pack_ids(seq.token_ids[: seq.prompt_len]), pack_floats(lp.logprobs),
                                        pack_ids(lp.top_ids.ravel()), pack_floats(lp.top_logprobs.ravel()))
            embedding = None if u.embedding is None else pack_floats(u.embedding)
            new.append(NewRequestInfo(seq.rid, seq.num_cached_tokens, queued, prompt, embedding))
    return StepOutput(
        step=step,
        rids=[u.seq.rid for u in updates],
        tokens=pack_ids([u.token_ids[0] if u.token_ids else -1 for u in updates]),
        finish=[u.finish_reason for u in updates],
        new=new,
        logprobs=step_logprobs([u.logprobs[0] if u.logprobs else None for u in updates]),
        engine=engine,
    )


def step_logprobs(rows: list[TokenLogprobs | None]) -> StepLogprobs | None:
    """The rows' logprobs as the wire's columns (None where no row asked): one array each, the top
    tables joined by one concatenate, never a message object per row."""
    asked = [row for row in rows if row is not None]
    if not asked:
        return None
    counts = np.array([-1 if row is None else len(row.top_ids) for row in rows], dtype=np.int32)
    lps = np.array([np.nan if row is None else row.logprob for row in rows], dtype=np.float32)
    top_ids = np.concatenate([row.top_ids for row in asked])
    top_lps = np.concatenate([row.top_logprobs for row in asked])
    return StepLogprobs(pack_floats(lps), pack_ids(counts), pack_ids(top_ids), pack_floats(top_lps))


class EngineLoop:
    def __init__(
        self,
        engine: Any,
        requests: zmq.Socket[Any],
        control: zmq.Socket[Any],
        steps: zmq.Socket[Any],
        errors: zmq.Socket[Any],
        status: zmq.Socket[Any],
        heartbeat: float = HEARTBEAT,
        index: int = 0,
    ) -> None:
        self.engine = engine
        self.more_stats: Callable[[], dict[str, int]] = dict  # the process's own counters (zmq_auth)
        self.index = index  # data parallel: this engine's place in the requests/control lists
        self.requests, self.control, self.steps = requests, control, steps
        self.errors, self.status = errors, status
        self.heartbeat = heartbeat
        self.boot = time.time_ns()  # differs across restarts
        self.info = ModelInfo(**engine.model_info(), max_logprobs=engine.config.max_logprobs)
        self.poller = zmq.Poller()
        self.poller.register(requests, zmq.POLLIN)
        self.poller.register(control, zmq.POLLIN)
        self.last_beat = float("-inf")
        self.finished = 0  # requests this engine finished (the per-engine share under data parallelism)

    def run(self, should_stop: Callable[[], bool]) -> None:
        while not should_stop():
            self.once()

    def stats(self) -> dict[str, int]:
        stats: dict[str, int] = self.engine.stats()
        return stats | {"finished": self.finished} | self.more_stats()

    def once(self) -> None:
        """One iteration: wait (only when idle), drain inputs, step, heartbeat."""
        now = time.monotonic()
        if self.engine.has_work():
            timeout = 0
        else:
            timeout = math.ceil(max(0.0, self.last_beat + self.heartbeat - now) * 1000)
        ready = dict(self.poller.poll(timeout))
        if self.requests in ready:
            for msg in self._drain(self.requests):  # adds and their aborts, in the order they came
                if isinstance(msg, EngineRequest):
                    self._add(msg)
                elif isinstance(msg, Abort):
                    self._abort(msg)
                else:
                    log.warning("dropped a %s message on the requests socket", msg.TAG)
        if self.control in ready:
            for msg in self._drain(self.control):
                if isinstance(msg, Abort):
                    self._abort(msg)
                else:
                    log.warning("dropped a %s message on the control socket", msg.TAG)
        stepped = False
        if self.engine.has_work():
            updates = self.engine.step()
            if refused := self.engine.take_refused():  # an error for the client instead of a finish
                updates = [u for u in updates if u.seq.rid not in refused]
                for rid, why in refused.items():
                    self._fail(rid, "INVALID_ARGUMENT", why)
            self.finished += sum(1 for u in updates if u.finish_reason)
            if updates:
                self.steps.send(encode(step_output(self.engine.step_count, updates, self.index)))
                stepped = True
        if time.monotonic() - self.last_beat >= self.heartbeat:
            self.last_beat = time.monotonic()
            stats = self.stats()
            tp = self.engine.config.tensor_parallel_size
            self.status.send(encode(EngineInfo(boot=self.boot, info=self.info, stats=stats, engine=self.index,
                                               tensor_parallel_size=tp)))
            if not stepped:
                self.steps.send(encode(step_output(self.engine.step_count, [], self.index)))

    def _drain(self, sock: zmq.Socket[Any]) -> list[Message]:
        out = []
        for _ in range(MAX_DRAIN):
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                out.append(decode(data))
            except MessageError as exc:
                log.warning("dropped a malformed message: %s", exc)
        return out

    def _abort(self, msg: Abort) -> None:
        for rid in msg.rids:
            self.engine.abort(rid, msg.reason)  # False: already finished (an abort never precedes its add)

    def _fail(self, rid: str, code: str, message: str) -> None:
        self.errors.send(encode(RequestError(rid=rid, code=code, message=message)))

    def _add(self, msg: EngineRequest) -> None:
        try:
            ids = unpack_ids(msg.prompt_ids).tolist()
        except MessageError as exc:
            self._fail(msg.rid, "INVALID_ARGUMENT", f"prompt_ids: {exc}")
            return
        # Only the engine knows its own context and pool: a prompt they cannot hold is the client's.
        problem = self.engine.capacity_problem(len(ids))
        if problem is not None:
            self._fail(msg.rid, "INVALID_ARGUMENT", problem)
            return
        # The gateway stamps wall-clock arrival; the engine keeps time on the monotonic clock.
        arrival = time.monotonic() - max(0.0, time.time() - msg.arrival) if msg.arrival else None
        try:
            lora = LoRARequest(msg.lora_name, msg.lora_id, msg.lora_path) if msg.lora_name else None
            self.engine.add(msg.rid, ids, msg.sampling, msg.app, arrival, msg.cache_salt, embed=msg.embed,
                            lora=lora)
        except LoRAError as exc:  # the adapter's directory went bad after the gateway checked it
            self._fail(msg.rid, "INVALID_ARGUMENT", f"LoRA adapter {msg.lora_name!r}: {exc}")
        except Exception as exc:  # an assertion (a bug upstream) must fail one request, not the engine
            log.exception("adding %s failed", msg.rid)
            self._fail(msg.rid, "INTERNAL", f"engine: {exc}")


def engine_threads(config: EngineConfig) -> int:
    """torch intra-op threads for an engine process with this config (see EngineConfig.cpu_threads)."""
    import torch

    from pipeserve.cpus import engine_core_count

    on_cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    if config.cpu_threads or on_cpu:
        return engine_core_count(config, len(os.sched_getaffinity(0)))
    return torch.get_num_threads()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, EngineConfig)
    cfg.add_arguments(parser, Addresses)
    parser.add_argument("--debug", action="store_true",
                        help="a start-up failure prints its traceback too, not only its one line")
    parser.add_argument("--heartbeat", type=float, default=HEARTBEAT, help="seconds between heartbeats")
    parser.add_argument("--engine-index", type=int, default=0,
                        help="data parallel: this engine's index (it binds that entry of --requests and "
                        "--control when they list one endpoint per engine)")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.model is None:
        args.model = os.environ.get("PIPESERVE_MODEL")  # as the tokenizer and detokenizer read it
    config, addrs = cfg.from_args(EngineConfig, args), cfg.from_args(Addresses, args)
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    import torch  # only in this process

    from pipeserve.engine.engine import Engine

    try:
        torch.set_num_threads(engine_threads(config))
        with phase("starting the engine", log):
            engine = Engine(config)
    except Exception as exc:  # noqa: BLE001 - every start-up failure is one line naming its flag
        return fail(getattr(args, "prog", "pipeserve engine"), exc, args.debug, config.device)
    ctx = zmq.Context()
    sockets = InternalSockets(ctx, InternalAuth(), f"engine {args.engine_index}")
    requests, control = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    for sock in (requests, control):
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # ZeroMQ refuses larger before we buffer them
    steps, errors, status = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    try:
        sockets.bind(requests, engine_endpoint(addrs.requests, args.engine_index))
        sockets.bind(control, engine_endpoint(addrs.control, args.engine_index))
        sockets.connect(steps, addrs.steps)
        sockets.connect(errors, addrs.errors)
        sockets.connect(status, addrs.status)
        loop = EngineLoop(engine, requests, control, steps, errors, status, args.heartbeat, args.engine_index)
        loop.more_stats = sockets.stats
        log.info(
            "ready (pid %d): engine %d, %s on %s; requests %s, control %s",
            os.getpid(),
            args.engine_index,
            loop.info.name,
            loop.info.device,
            engine_endpoint(addrs.requests, args.engine_index),
            engine_endpoint(addrs.control, args.engine_index),
        )
        loop.run(lambda: bool(stopping))
    finally:
        engine.close()
        sockets.close()
        ctx.destroy(linger=500)
    return 0
