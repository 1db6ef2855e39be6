"""The engine process (`pipeserve engine`): the loop that wraps Engine in sockets.

Binds `requests` (PULL EngineRequest from the tokenizers) and `control` (PULL Abort from the
gateway and the detokenizer), connects `steps` (PUSH StepOutput to the detokenizer) and `errors`
(PUSH RequestError and EngineInfo to the gateway). It binds only once the model is loaded, so
an open port means ready.

Between two steps it drains everything queued on both inputs without blocking (a blocking poll
only when idle, woken by input or the heartbeat), adds the requests, then applies the aborts: at
a step boundary, after the adds they may refer to (the engine tombstones those that overtook
their add through another path). Every step output carries the engine's counters. Idle, it
sends an empty StepOutput every heartbeat (the detokenizer forwards its stats, proving the path
alive); always, an EngineInfo (ModelInfo's data; the boot id tells the gateway of a restart).
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

import zmq

from services import config as cfg
from services.config import Addresses, EngineConfig
from services.messages import (
    MAX_MESSAGE_BYTES,
    Abort,
    EngineInfo,
    EngineRequest,
    Message,
    MessageError,
    RequestError,
    StepOutput,
    decode,
    encode,
    unpack_ids,
)
from services.sampling_params import SamplingParams

log = logging.getLogger("pipeserve.engine")

HEARTBEAT = 0.5  # seconds
MAX_DRAIN = 4096  # messages taken from one socket between two steps (bounded so steps keep coming)


class EngineLoop:
    def __init__(
        self,
        engine: Any,
        requests: zmq.Socket,
        control: zmq.Socket,
        steps: zmq.Socket,
        errors: zmq.Socket,
        heartbeat: float = HEARTBEAT,
    ) -> None:
        self.engine = engine
        self.requests, self.control, self.steps, self.errors = requests, control, steps, errors
        self.heartbeat = heartbeat
        self.boot = time.time_ns()  # differs across restarts
        self.info = dict(engine.model_info(), max_logprobs=engine.config.max_logprobs)
        self.poller = zmq.Poller()
        self.poller.register(requests, zmq.POLLIN)
        self.poller.register(control, zmq.POLLIN)
        self.last_beat = float("-inf")

    def run(self, should_stop: Callable[[], bool]) -> None:
        while not should_stop():
            self.once()

    def once(self) -> None:
        """One iteration: wait (only when idle), drain inputs, step, heartbeat."""
        now = time.monotonic()
        if self.engine.has_work():
            timeout = 0
        else:
            timeout = math.ceil(max(0.0, self.last_beat + self.heartbeat - now) * 1000)
        ready = dict(self.poller.poll(timeout))
        aborts: list[Abort] = []
        if self.requests in ready:
            for msg in self._drain(self.requests):
                if isinstance(msg, EngineRequest):
                    self._add(msg)
                else:
                    log.warning("dropped a %s message on the requests socket", msg.TAG)
        if self.control in ready:
            for msg in self._drain(self.control):
                if isinstance(msg, Abort):
                    aborts.append(msg)
                else:
                    log.warning("dropped a %s message on the control socket", msg.TAG)
        for abort in aborts:
            for rid in abort.rids:
                self.engine.abort(rid, abort.reason)
        stepped = False
        if self.engine.has_work():
            out = self.engine.step()
            out.stats = self.engine.stats()
            if out.rids or out.new:
                self.steps.send(encode(out))
                stepped = True
        if time.monotonic() - self.last_beat >= self.heartbeat:
            self.last_beat = time.monotonic()
            stats = self.engine.stats()
            self.errors.send(encode(EngineInfo(boot=self.boot, info=self.info, stats=stats)))
            if not stepped:
                self.steps.send(
                    encode(
                        StepOutput(step=self.engine.step_count, rids=[], tokens=b"", finish=[], stats=stats)
                    )
                )

    def _drain(self, sock: zmq.Socket) -> list[Message]:
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

    def _add(self, msg: EngineRequest) -> None:
        try:
            params = SamplingParams.from_dict(msg.sampling)
            ids = unpack_ids(msg.prompt_ids).tolist()
            # The gateway stamps wall-clock arrival; the engine keeps time on the monotonic clock.
            arrival = time.monotonic() - max(0.0, time.time() - msg.arrival) if msg.arrival else None
            self.engine.add(msg.rid, ids, params, msg.app, arrival)
        except (ValueError, TypeError) as exc:  # MessageError is a ValueError
            self.errors.send(encode(RequestError(rid=msg.rid, code="INVALID_ARGUMENT", message=str(exc))))
        except Exception as exc:  # a bug on one request must not take the engine down
            log.exception("adding %s failed", msg.rid)
            self.errors.send(encode(RequestError(rid=msg.rid, code="INTERNAL", message=f"engine: {exc}")))


def engine_threads(config: EngineConfig) -> int:
    """torch intra-op threads for an engine process with this config (see EngineConfig.cpu_threads)."""
    import torch

    from services.cpus import engine_core_count

    on_cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    if config.cpu_threads or on_cpu:
        return engine_core_count(config, len(os.sched_getaffinity(0)))
    return torch.get_num_threads()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, EngineConfig)
    cfg.add_arguments(parser, Addresses)
    parser.add_argument("--heartbeat", type=float, default=HEARTBEAT, help="seconds between heartbeats")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.model is None:
        args.model = os.environ.get("PIPESERVE_MODEL")  # as the tokenizer and detokenizer read it
    config, addrs = cfg.from_args(EngineConfig, args), cfg.from_args(Addresses, args)
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    import torch  # only in this process

    from services.engine.engine import Engine

    torch.set_num_threads(engine_threads(config))
    engine = Engine(config)
    ctx = zmq.Context()
    requests, control = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    for sock in (requests, control):
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # ZeroMQ refuses larger before we buffer them
    steps, errors = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    try:
        requests.bind(addrs.requests)
        control.bind(addrs.control)
        steps.connect(addrs.steps)
        errors.connect(addrs.errors)
        loop = EngineLoop(engine, requests, control, steps, errors, args.heartbeat)
        log.info(
            "ready (pid %d): %s on %s; requests %s, control %s",
            os.getpid(),
            loop.info.get("name"),
            loop.info.get("device"),
            addrs.requests,
            addrs.control,
        )
        loop.run(lambda: bool(stopping))
    finally:
        engine.close()
        ctx.destroy(linger=500)
    return 0
