"""A whole `pipeserve up` wired over tcp:// (as across hosts: CURVE with a key pair made for this
start): it serves, and rogue ZeroMQ peers with no key or their own pair, aimed at the engine's
requests socket and the gateway's tokenize socket, get nothing in (the engine runs nothing of
theirs) and nothing out (no request reaches a rogue "tokenizer"); the refusals show in
pipeserve_zmq_refused."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from pipeserve.local_cluster import LocalCluster
from pipeserve.messages import EngineRequest, WorkerReady, decode, encode, pack_ids
from pipeserve.sampling_params import SamplingParams
from tests.reliability.conftest import start

pytestmark = [pytest.mark.serial, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def tcp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with start(tmp_path_factory.mktemp("curve") / "up.log", "--zmq-over", "tcp", workers=1) as up:
        yield up


def addresses(cluster: LocalCluster) -> dict[str, str]:
    """The children's ZeroMQ endpoints, from the gateway's environment."""
    (gateway,) = cluster.pids("gateway")
    env = Path(f"/proc/{gateway}/environ").read_bytes().split(b"\0")
    pairs = dict(item.decode().split("=", 1) for item in env if item.startswith(b"PIPESERVE_"))
    return {m.group(1).lower(): value for name, value in pairs.items()
            if (m := re.fullmatch(r"PIPESERVE_(\w+)_ADDR", name))}


def rogue(ctx: zmq.Context[Any], kind: int, keyed: bool) -> zmq.Socket[Any]:
    sock = ctx.socket(kind)
    sock.linger = 0
    if keyed:  # its own pair; it cannot know ours
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = zmq.curve_keypair()[0]
    return sock


def complete(cluster: LocalCluster, n: int) -> None:
    with httpx.Client(base_url=cluster.http_url, timeout=60) as http:
        for _ in range(n):
            r = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.slow  # a whole pipeline over tcp://
def test_tcp_pipeline_serves_and_refuses_rogues(tcp_cluster: LocalCluster) -> None:
    addrs = addresses(tcp_cluster)
    assert all(value.startswith("tcp://127.0.0.1:") for value in addrs.values()), addrs
    assert "CURVE" in tcp_cluster.log_path.read_text()
    complete(tcp_cluster, 2)
    finished = tcp_cluster.settled_engine("finished", 0)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        rogues = []
        for keyed in (False, True):
            # In: an EngineRequest straight to the engine (bypassing the gateway's key and limits).
            push = rogue(ctx, zmq.PUSH, keyed)
            push.connect(addrs["requests"])
            request = EngineRequest(f"rogue-{keyed}", pack_ids([1, 2, 3]), SamplingParams(max_tokens=50))
            with contextlib.suppress(zmq.Again):
                push.send(encode(request), zmq.NOBLOCK)
            # Out: a "tokenizer worker" announcing itself to the gateway, to be handed requests.
            dealer = rogue(ctx, zmq.DEALER, keyed)
            dealer.setsockopt(zmq.ROUTING_ID, f"rogue-{keyed}".encode())
            dealer.connect(addrs["tokenize"])
            with contextlib.suppress(zmq.Again):
                dealer.send(encode(WorkerReady("rogue")), zmq.NOBLOCK)
            rogues += [push, dealer]
        time.sleep(1.0)
        complete(tcp_cluster, 6)  # round robin would hand a rogue worker some of them
        for dealer in rogues[1::2]:
            assert not dealer.poll(100), f"a rogue got {decode(dealer.recv())!r}"
        # The engine ran the keyed requests only (its counter reaches the gateway in heartbeats).
        assert tcp_cluster.settled_engine("finished", finished) == finished + 6
        metrics = tcp_cluster.metrics()
        assert metrics['pipeserve_zmq_refused_total{process="engine-0"}'] >= 2
        assert metrics['pipeserve_zmq_refused_total{process="gateway"}'] >= 2
        assert "Traceback" not in tcp_cluster.log_path.read_text()
    finally:
        ctx.destroy(linger=0)
