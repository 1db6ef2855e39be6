"""What the processes that hold a tokenizer share (the tokenizer workers and the detokenizer): their
flags, their start (logging, SIGTERM, the EngineConfig), their sockets to the engines and the
ZeroMQ context of their serve loop. Loading the tokenizer itself: pipeserve/tokenizer/load.py."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import zmq

from pipeserve import config as cfg
from pipeserve.config import Addresses, EngineConfig, InternalAuth, engine_endpoints
from pipeserve.zmq_auth import InternalSockets


def add_worker_arguments(parser: argparse.ArgumentParser, sockets: dict[str, str]) -> None:
    """A worker's flags: which tokenizer (EngineConfig's tokenizer fields), its sockets ({Addresses
    field: what the worker does with it}) and the log level."""
    cfg.add_arguments(parser, EngineConfig, only=cfg.TOKENIZER_FIELDS)
    addresses = Addresses()
    for name, role in sockets.items():
        parser.add_argument(f"--{name}", default=getattr(addresses, name), help=role)
    parser.add_argument("--log-level", default="INFO", help="logging level")


def start_worker(args: argparse.Namespace, name: str) -> EngineConfig:
    """Logging, SIGTERM as a clean exit, and the worker's EngineConfig (--model defaults to
    $PIPESERVE_MODEL, which the launcher and compose set for every process)."""
    logging.basicConfig(level=args.log_level.upper(), force=True,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    args.model = args.model or os.environ.get("PIPESERVE_MODEL")
    config: EngineConfig = cfg.from_args(EngineConfig, args)
    return config


def connect_engines(internal: InternalSockets, endpoints: str) -> list[zmq.Socket[bytes]]:
    """One PUSH socket per engine (a requests or control address lists one endpoint per engine):
    element i reaches engine i only, so a request and its aborts go where the gateway routed it."""
    sockets = []
    for endpoint in engine_endpoints(endpoints):
        sock = internal.ctx.socket(zmq.PUSH)
        internal.connect(sock, endpoint)
        sockets.append(sock)
    return sockets


@contextmanager
def worker_sockets(process: str) -> Iterator[InternalSockets]:
    """The worker's ZeroMQ context, and its internal sockets' CURVE (pipeserve/zmq_auth.py), for the
    life of its serve loop; Ctrl-C is a clean exit, and queued messages get half a second to leave."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    internal = InternalSockets(ctx, InternalAuth(), process)
    try:
        yield internal
    except KeyboardInterrupt:
        pass
    finally:
        internal.close()
        ctx.destroy(linger=500)
