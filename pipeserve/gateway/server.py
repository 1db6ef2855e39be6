"""The gateway process (`pipeserve gateway`): the core (gateway/requests.py) with its front ends,
gRPC (gateway/grpc_api.py) always, the OpenAI HTTP API (gateway/openai_api.py) with --http-port,
and Prometheus /metrics with --metrics-port. This module only assembles them and runs the process;
it imports each front end, and none of them imports it.

The instance id ($PIPESERVE_INSTANCE_ID, set by `pipeserve up`, else random) is the extra service
name the gRPC health service answers for (see grpc_api.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import Any

import uvloop
from prometheus_client import start_http_server

from pipeserve import config as cfg
from pipeserve.config import (
    LORA_FIELDS,
    TOKENIZER_FIELDS,
    Addresses,
    EngineConfig,
    GatewayConfig,
    new_instance_id,
)
from pipeserve.gateway.adapters import Adapters
from pipeserve.gateway.grpc_api import GrpcFrontEnd
from pipeserve.gateway.requests import Core
from pipeserve.lora import LoRAError
from pipeserve.startup import StartupError, fail

log = logging.getLogger("pipeserve.gateway")


class PortInUse(OSError):
    def __init__(self, host: str, port: int, flag: str = "--port") -> None:
        super().__init__(f"cannot listen on {host}:{port}: the port is in use (another pipeserve?); "
                         f"stop that server or pick another {flag}")


class Gateway:
    """One gateway: the core and its front ends, started and stopped in order."""

    def __init__(self, config: GatewayConfig, addrs: Addresses, instance_id: str = "",
                 tokenizer_config: EngineConfig | None = None) -> None:
        self.config = config
        self.instance_id = instance_id or new_instance_id()
        self.core = Core(config, addrs)
        self.core.adapters = Adapters.from_config(tokenizer_config)  # LoRAError: a bad --lora-modules entry
        self.grpc = GrpcFrontEnd(self.core, config, self.instance_id)
        self.http: Any = None  # the OpenAI HTTP front end, with --http-port
        self.tokenizer_config = tokenizer_config  # what /tokenize and /detokenize load, on first use
        self.port = 0
        self._metrics: Any = None

    async def start(self) -> int:
        """Bind everything (PortInUse when a port is taken) and start serving; the gRPC port."""
        self.core.bind()
        self.port = await self.grpc.start()
        if not self.port:
            await self.core.stop()
            raise PortInUse(self.config.host, self.config.port)
        if self.config.http_port is not None:
            from pipeserve.gateway.openai_api import OpenAIServer  # FastAPI: only when HTTP is on

            self.http = OpenAIServer(self.core, self.config, self.tokenizer_config)
            try:
                await self.http.start(self.config.host, self.config.http_port)
            except OSError:
                await self.grpc.stop(0)
                await self.core.stop()
                raise PortInUse(self.config.host, self.config.http_port, "--http-port") from None
        self.core.start()
        if self.config.metrics_port is not None:
            self._metrics = start_http_server(self.config.metrics_port, self.config.host,
                                              self.core.metrics.registry)
        return self.port

    async def stop(self, grace: float) -> None:
        """Stop taking calls, let in-flight streams finish within grace, then cancel the rest."""
        await self.grpc.stop(grace)
        if self.http is not None:
            await self.http.stop()
        await self.core.stop()
        if self._metrics is not None:
            self._metrics[0].shutdown()


async def serve(config: GatewayConfig, addrs: Addresses, tokenizer: EngineConfig | None = None) -> int:
    try:
        gateway = Gateway(config, addrs, os.environ.get("PIPESERVE_INSTANCE_ID", ""), tokenizer)
    except LoRAError as exc:
        return fail("pipeserve gateway", StartupError(f"--lora-modules: {exc}"))
    try:
        port = await gateway.start()
    except PortInUse as exc:  # taken since `up` checked it, or a gateway run on its own
        return fail("pipeserve gateway", StartupError(str(exc)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("gateway listening on %s:%d (instance %s)", config.host, port, gateway.instance_id)
    if gateway.http is not None:
        log.info("OpenAI-compatible HTTP API on %s:%d", config.host, gateway.http.port)
    await stop.wait()
    log.info("shutting down, %d streams get %.1f s to finish", len(gateway.core.streams), config.grace)
    await gateway.stop(config.grace)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, GatewayConfig)
    cfg.add_arguments(parser, Addresses)
    # The tokenizer /tokenize serves, and the LoRA adapters the requests may name.
    cfg.add_arguments(parser, EngineConfig, only=TOKENIZER_FIELDS + LORA_FIELDS)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args.model = args.model or os.environ.get("PIPESERVE_MODEL")
    tokenizer = cfg.from_args(EngineConfig, args)
    return uvloop.run(serve(cfg.from_args(GatewayConfig, args), cfg.from_args(Addresses, args), tokenizer))
