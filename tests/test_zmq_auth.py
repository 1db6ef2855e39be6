"""CURVE on the internal tcp:// sockets (pipeserve/zmq_auth.py): a peer with the deployment's key
pair gets through; one with no key, another key pair or a wrong server key gets nothing in and
nothing out, and each refusal is counted. ipc:// is left as it is."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from pipeserve.config import InternalAuth
from pipeserve.local_cluster import free_port
from pipeserve.startup import StartupError
from pipeserve.zmq_auth import InternalSockets, KeyPair, generate

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def key(tmp_path: Path) -> str:
    path = str(tmp_path / "zmq.key")
    generate(path)
    return path


def socket(ctx: zmq.Context[Any], kind: int) -> zmq.Socket[Any]:
    sock = ctx.socket(kind)
    sock.linger = 0
    return sock


def rogue(ctx: zmq.Context[Any], kind: int, how: str, ours: KeyPair) -> zmq.Socket[Any]:
    """A peer without our key: none (no CURVE), its own pair (our public server key is no secret),
    or our pair's public half with a made-up secret and server key."""
    sock = socket(ctx, kind)
    if how == "own pair":
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = ours.public
    elif how == "wrong server key":
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = zmq.curve_keypair()[0]
    return sock


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.mark.parametrize("how", ["no key", "own pair", "wrong server key"])
def test_a_rogue_gets_nothing_in_and_nothing_out(ctx, key: str, how: str) -> None:
    ours = KeyPair.load(key)
    server = InternalSockets(ctx, InternalAuth(key), "test")
    client = InternalSockets(ctx, InternalAuth(key), "client")
    inbox, outbox = socket(ctx, zmq.PULL), socket(ctx, zmq.PUSH)
    inbox_at, outbox_at = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    try:
        server.bind(inbox, inbox_at)
        server.bind(outbox, outbox_at)
        # In: the rogue's message never arrives; a keyed peer's does.
        bad_in = rogue(ctx, zmq.PUSH, how, ours)
        bad_in.connect(inbox_at)
        with contextlib.suppress(zmq.Again):  # queued only once a handshake succeeds: never
            bad_in.send(b"rogue", zmq.NOBLOCK)
        wait_for(lambda: server.refused >= 1)
        good_in = socket(ctx, zmq.PUSH)
        client.connect(good_in, inbox_at)
        good_in.send(b"keyed")
        assert inbox.recv() == b"keyed"
        assert not inbox.poll(300), "a rogue's message got in"
        # Out: the binder's messages go to the keyed peer only, never to the rogue.
        bad_out = rogue(ctx, zmq.PULL, how, ours)
        bad_out.connect(outbox_at)
        wait_for(lambda: server.refused >= 2)
        good_out = socket(ctx, zmq.PULL)
        client.connect(good_out, outbox_at)
        for i in range(10):
            outbox.send(b"%d" % i)
        assert [good_out.recv() for _ in range(10)] == [b"%d" % i for i in range(10)]
        assert not bad_out.poll(300), "a rogue received a message"
        assert server.stats() == {"zmq_refused": server.refused}
    finally:
        server.close()
        client.close()


def test_tcp_bind_without_a_key_is_refused_and_ipc_is_untouched(ctx, tmp_path: Path) -> None:
    internal = InternalSockets(ctx, InternalAuth(None), "test")
    with pytest.raises(StartupError, match="without a ZeroMQ key"):
        internal.bind(socket(ctx, zmq.PULL), f"tcp://127.0.0.1:{free_port()}")
    pull, push = socket(ctx, zmq.PULL), socket(ctx, zmq.PUSH)
    internal.bind(pull, f"ipc://{tmp_path}/x")
    push.connect(f"ipc://{tmp_path}/x")  # a plain peer, as every process on one host is
    push.send(b"hi")
    assert pull.recv() == b"hi" and not pull.curve_server and internal.stats() == {}
    internal.close()


def test_key_file_is_private_and_round_trips(key: str, tmp_path: Path) -> None:
    assert Path(key).stat().st_mode & 0o777 == 0o600
    pair = KeyPair.load(key)
    assert len(pair.public) == len(pair.secret) == 40 and zmq.curve_public(pair.secret) == pair.public
    (tmp_path / "public-only").write_text(f'curve\n    public-key = "{pair.public.decode()}"\n')
    with pytest.raises(StartupError, match="no secret key"):
        KeyPair.load(str(tmp_path / "public-only"))
