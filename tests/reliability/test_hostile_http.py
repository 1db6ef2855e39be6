"""Hostile HTTP traffic against `pipeserve up` (pipeserve/bench/hostile_http.py, the scenario `bench
reliability` reports, run small): bad bodies and content types, wrong paths and methods, clients
that leave mid-headers, mid-body and mid-stream, streams nobody reads, slow headers, a heavy logprob
request beside a liveness probe. Every refusal is OpenAI-shaped and names the field, nothing is left
behind, and the server's log holds no traceback and no error for any of it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pipeserve.bench import hostile_http

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(300)]  # a whole `pipeserve up`


def test_hostile_http_leaves_no_traceback_and_no_state(pipeline: Any) -> None:
    figures = hostile_http.run(pipeline, heavy_streams=1, heavy_n=8, heavy_tokens=200, slow_connections=2)
    assert figures["passed"] == figures["tried"], figures["failed"]
    assert not any(figures["disconnect_state_left"].values()) and not any(figures["state_left"].values())
    slow = figures["slow_headers"]
    assert slow["closed"] == slow["connections"] and not math.isnan(slow["closed_after_s_max"])
    heavy = figures["heavy"]
    assert min(heavy["events"]) >= 8 and heavy["health"]["probes"] and heavy["health_not_ok"] == 0
    assert figures["log_tracebacks"] == figures["log_errors"] == 0
