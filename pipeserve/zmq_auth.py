"""ZeroMQ CURVE on the internal sockets that cross hosts (tcp://): authenticated and encrypted.

One key pair per deployment (a ZeroMQ certificate file holding its public and secret key): the
launcher generates it, or the operator gives it (compose, hand-started processes), and every process
reads it from InternalAuth (pipeserve/config.py). A socket that binds a tcp:// address is a CURVE
server with that pair, and a ZAP handler admits only peers that prove they hold the same pair; a
socket that connects to a tcp:// address is a CURVE client with it. A peer without the key (no
CURVE, another key pair, a wrong server key) fails the handshake: it can neither send nor receive,
and each refusal is counted (`refused`, reported to the gateway's metrics). ipc:// sockets stay as
they are: the launcher's private run directory (mode 0700) already keeps other users out.

A tcp:// bind without a key is refused at start (StartupError: one line naming the fix): nothing
internal listens on the network open.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from pipeserve.config import ZMQ_INSECURE_ENV, InternalAuth
from pipeserve.startup import StartupError

log = logging.getLogger("pipeserve.zmq_auth")

ZAP_DOMAIN = "pipeserve"
# What a refused peer's handshake ends with on the binding side: no or another mechanism and broken
# crypto (a wrong server key) are protocol failures, an unknown client key an authentication failure.
REFUSALS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85
    secret: bytes

    @classmethod
    def load(cls, path: str) -> KeyPair:
        """The pair in a ZeroMQ certificate file (`pipeserve zmq-keygen` or zmq.auth writes them)."""
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise StartupError(f"cannot read the ZeroMQ key file {path}: {exc}") from None
        if not secret:
            raise StartupError(f"the ZeroMQ key file {path} holds no secret key (give the secret one)")
        return cls(public, secret)


def generate(path: str) -> KeyPair:
    """A new key pair, written to path (mode 0600, replacing what was there) as a certificate file."""
    public, secret = zmq.curve_keypair()
    text = ("#   pipeserve: the deployment's ZeroMQ CURVE key pair (secret: readable by its processes only)\n"
            "metadata\ncurve\n"
            f'    public-key = "{public.decode()}"\n    secret-key = "{secret.decode()}"\n')
    target = Path(path)
    fd = os.open(target.with_name(target.name + ".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(target.with_name(target.name + ".tmp"), target)
    return KeyPair(public, secret)


def is_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


class _OnlyOurKey:
    """The ZAP credentials check: the deployment's own public key, nothing else."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and key == self.public


class InternalSockets:
    """One process's internal sockets: bind and connect through it, so tcp:// ones get CURVE. It
    starts the ZAP handler and a monitor of refused handshakes on first tcp:// bind; close() before
    the context goes."""

    def __init__(self, ctx: zmq.Context[Any], auth: InternalAuth, process: str) -> None:
        self.ctx, self.process = ctx, process
        self.keys = KeyPair.load(auth.key_file) if auth.key_file else None
        self.insecure = auth.insecure and self.keys is None
        self.refused = 0  # handshakes refused on this process's tcp:// binds
        self._sync: zmq.Context[Any] = zmq.Context.shadow(ctx.underlying)  # the ZAP thread's and monitors'
        self._auth: ThreadAuthenticator | None = None
        self._monitors: list[zmq.Socket[Any]] = []
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()
        self._logged = False

    def bind(self, sock: zmq.Socket[Any], endpoint: str) -> None:
        if is_tcp(endpoint) and self.insecure:
            log.warning("%s: %s is open to anyone who reaches it (%s=1: no CURVE)", self.process,
                        endpoint, ZMQ_INSECURE_ENV)
        elif is_tcp(endpoint):
            if self.keys is None:
                raise StartupError(f"{self.process}: refusing to bind {endpoint} without a ZeroMQ key: "
                                 "internal sockets on tcp:// need the deployment's key pair "
                                 "(--zmq-key-file or PIPESERVE_ZMQ_KEY_FILE; `pipeserve zmq-keygen PATH` "
                                 "makes one)")
            self._log_once()
            self._start_auth()
            sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
            sock.curve_server = True
            sock.zap_domain = ZAP_DOMAIN.encode()
            self._watch(sock)
        sock.bind(endpoint)

    def connect(self, sock: zmq.Socket[Any], endpoint: str) -> None:
        if is_tcp(endpoint) and self.keys is not None:
            self._log_once()
            sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
            sock.curve_serverkey = self.keys.public
        sock.connect(endpoint)

    def stats(self) -> dict[str, int]:
        """The counter reported to the gateway (heartbeats): refused handshakes."""
        return {"zmq_refused": self.refused} if self._auth is not None else {}

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=2)
        for monitor in self._monitors:
            monitor.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    # ---- internals ----------------------------------------------------------------------------
    def _log_once(self) -> None:
        if not self._logged:
            self._logged = True
            log.info("%s: tcp:// sockets use CURVE with the deployment's key (public %s...)", self.process,
                     self.keys.public[:8].decode() if self.keys else "")

    def _start_auth(self) -> None:
        if self._auth is None and self.keys is not None:
            self._auth = ThreadAuthenticator(self._sync, log=logging.getLogger("pipeserve.zmq_auth.zap"))
            self._auth.start()
            only_ours = _OnlyOurKey(self.keys.public)
            self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=only_ours)

    def _watch(self, sock: zmq.Socket[Any]) -> None:
        """Count the socket's refused handshakes (a monitor socket read by one thread per process)."""
        address = f"inproc://pipeserve-monitor-{id(sock)}"
        sock.monitor(address, REFUSALS)
        monitor = self._sync.socket(zmq.PAIR)
        monitor.connect(address)
        self._monitors.append(monitor)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._count, name="zmq-auth-monitor", daemon=True)
            self._watcher.start()

    def _count(self) -> None:
        while not self._stop.is_set():
            poller = zmq.Poller()
            for monitor in list(self._monitors):
                poller.register(monitor, zmq.POLLIN)
            try:
                ready = poller.poll(200)
                for monitor, _ in ready:
                    event = recv_monitor_message(monitor)
                    if event["event"] & REFUSALS:
                        self.refused += 1
                        log.warning("%s: refused a ZeroMQ peer at %s (no or a wrong key)", self.process,
                                    event.get("endpoint", b"").decode(errors="replace"))
            except zmq.ZMQError:
                return  # the context is going


# ---- `pipeserve zmq-keygen` -------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="the key file to write (mode 0600); give it to every process as "
                                     "PIPESERVE_ZMQ_KEY_FILE, or to `pipeserve up --zmq-key-file`")


def main(args: argparse.Namespace) -> int:
    keys = generate(args.path)
    print(f"wrote {args.path} (public key {keys.public.decode()})")
    return 0
