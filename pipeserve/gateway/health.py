"""Whether the gateway is SERVING: its view of the pipeline's liveness, transport-free.

SERVING means the detokenizer's output flows (its heartbeats arrive, and none older than its last
restart count), the engine reported what it serves, at least one engine is live and at least one
tokenizer worker has announced itself. Both front
ends read the one answer: gRPC's health service and HTTP's /health.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeserve.gateway.router import Router
from pipeserve.messages import ModelInfo

# Processes whose death breaks every in-flight stream (an engine's death breaks its own only).
PIPELINE = ("detokenizer",)


@dataclass
class PipelineHealth:
    """The detokenizer's heartbeats and the supervisor's process reports (engines: the router's views)."""

    seen: float = float("-inf")  # monotonic time of the detokenizer's last message
    fresh_after: float = float("-inf")  # its messages at or before this do not count (a restart)
    down: set[str] = field(default_factory=set)  # pipeline processes reported down

    def healthy(self, router: Router, info: ModelInfo | None, now: float, timeout: float,
                workers: int) -> bool:
        return (
            workers > 0
            and not self.down
            and info is not None
            and self.fresh_after < self.seen
            and now - self.seen < timeout
            and any(view.live for view in router.engines)
        )

    def why_not(self, router: Router, info: ModelInfo | None, workers: int) -> str:
        """Why healthy() is False, in the words a refused client reads."""
        dead = [f"engine-{i}" for i, view in enumerate(router.engines) if view.down]
        if self.down or len(dead) == len(router.engines):
            return f"not serving: {', '.join(sorted(self.down | set(dead)))} down"
        if info is None:
            return "not serving: the engine has not reported yet"
        if not workers:
            return "not serving: no tokenizer worker is connected"
        return "not serving: no heartbeat from the engine and detokenizer"

    def process(self, name: str, up: bool, now: float) -> None:
        """A pipeline process (PIPELINE) went down or came back (SERVING again after a fresh heartbeat)."""
        if up:
            self.down.discard(name)
            self.fresh_after = now
        else:
            self.down.add(name)


def engine_index(process: str) -> int | None:
    """The engine a supervisor's process name is ("engine-1": 1; "engine": 0), None for the others."""
    if process == "engine":
        return 0
    prefix, _, index = process.partition("-")
    return int(index) if prefix == "engine" and index.isdigit() else None
