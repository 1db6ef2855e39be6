"""Limits on the HTTP front end's connections (uvicorn's httptools protocol, extended): a client has
`--http-header-timeout` seconds from its first byte (or from connecting) to finish a request's
headers and `--http-body-timeout` more to finish its body, else the connection closes; at most
`--http-max-connections` connections are open at once, another is answered 503 (OpenAI's error
shape) and closed; idle keep-alive connections close after `--http-keepalive-timeout` (uvicorn's own
timer). Every refusal is counted (`pipeserve_gateway_http_refused_total{reason}`), so slow or
flooding clients show in the metrics instead of holding sockets forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pipeserve.config import GatewayConfig

log = logging.getLogger("pipeserve.gateway.http")

def _over_capacity(limit: int) -> bytes:
    body = json.dumps({"error": {"message": f"over {limit} open connections (--http-max-connections); retry",
                                 "type": "server_error", "param": None, "code": "max_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n")
    return head.encode() + body


def limited_protocol(config: GatewayConfig, refused: Callable[[str], None]) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol under config's connection limits; refused(reason) counts one."""
    full = _over_capacity(config.http_max_connections)

    class LimitedProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= config.http_max_connections:
                refused("max_connections")
                self.transport = transport  # what connection_lost closes
                transport.write(full)
                transport.close()
                return
            super().connection_made(transport)
            self._arm(config.http_header_timeout, "header_timeout")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm(config.http_header_timeout, "header_timeout")  # a keep-alive connection's next request

        def on_headers_complete(self) -> None:
            self._arm(config.http_body_timeout, "body_timeout")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, seconds: float, reason: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired, reason)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, reason: str) -> None:
            self._deadline = None
            refused(reason)
            log.debug("closed a connection from %s: %s", self.client, reason.replace("_", " "))
            self.transport.close()

    return LimitedProtocol


def uvicorn_options(config: GatewayConfig, refused: Callable[[str], None]) -> dict[str, Any]:
    """The uvicorn.Config keyword arguments that apply the limits."""
    return {"http": limited_protocol(config, refused), "timeout_keep_alive": config.http_keepalive_timeout}
