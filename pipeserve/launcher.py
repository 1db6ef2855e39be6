"""`pipeserve up`: every process on this host over ipc:// sockets, supervised.

Starts the engine, the detokenizer, N tokenizer workers and the gateway as subprocesses wired
through ipc:// sockets in a private temp dir, waits until the gateway's health says SERVING,
then supervises: a process that dies is restarted (engine included), and the gateway is told at
once (ProcessStatus on its `status` socket) so that it ends the streams the death broke with
UNAVAILABLE and reports NOT_SERVING until the pipeline is whole again. With --data-parallel-size N
it starts N engines (engine-0 ...), each binding its own requests/control endpoint; with --ray the
same children run on a Ray cluster's nodes (pipeserve/ray_launcher.py), supervised the same way.
SIGINT/SIGTERM shut down in order: the gateway first (in-flight streams get --grace seconds to
finish while the rest still runs), then the others. Children run in their own sessions (a
terminal's Ctrl-C reaches only this process, which orders the shutdown) and die with it if it is
killed (PR_SET_PDEATHSIG).

Before any process starts, pipeserve/preflight.py checks the ports, the model and the tokenizer, and a
problem ends `up` with one line saying what to do. The gateway's readiness is checked for the
instance id this launcher gave it, so another server on the same port can never answer for it.
Every process is named in `ps` (`pipeserve: engine`, `pipeserve: tokenizer 0`, ...).

`running()` is that start and stop without the supervision loop, for a benchmark that swaps in its
own engine (pipeserve/bench/pipeline.py); pipeserve/local_cluster.py runs the whole of `pipeserve up` in a
subprocess for tests and benchmarks, and finds its children through children_of().
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import zmq

from pipeserve import config as cfg
from pipeserve import preflight
from pipeserve.child import TITLE, Child, Starter, set_title, start_local
from pipeserve.config import (
    Addresses,
    EngineConfig,
    GatewayConfig,
    InternalAuth,
    LaunchConfig,
    new_instance_id,
)
from pipeserve.cpus import CpuSplit, claim_split, cpu_split, cpus_env, engine_core_sets
from pipeserve.messages import ProcessStatus, encode
from pipeserve.preflight import check_ports
from pipeserve.startup import EXIT_STARTUP, StartupError, fail
from pipeserve.zmq_auth import InternalSockets, generate

log = logging.getLogger("pipeserve.up")

MAX_RESTARTS = 5  # per child within RESTART_WINDOW, then give up and shut down
RESTART_WINDOW = 60.0
STOP_TIMEOUT = 10.0
DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible API's port under `up` (as vLLM's)


def children_of(pid: int) -> dict[int, str]:
    """pid -> subcommand ("engine", "tokenizer", ...) of a launcher's live (not zombie) children."""
    out = {}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            argv = Path(f"/proc/{child}/cmdline").read_text().split("\0")
            if Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] == "Z":
                continue
            if argv[0].startswith(TITLE):  # named: "pipeserve: tokenizer 1"
                out[int(child)] = argv[0].removeprefix(TITLE).split()[0]
            else:  # not yet named: python -c CHILD <subcommand> ...
                out[int(child)] = argv[3]
        except (FileNotFoundError, IndexError):
            continue
    return out


class Supervisor:
    def __init__(
        self, children: list[Child], addrs: Addresses, env: dict[str, str], start: Starter = start_local,
        key_file: str | None = None,
    ) -> None:
        self.children = children
        self.env = env
        self.start = start
        self._zmq = zmq.Context()
        self._internal = InternalSockets(self._zmq, InternalAuth(key_file), "supervisor")
        self._status = self._zmq.socket(zmq.PUSH)
        self._status.setsockopt(zmq.LINGER, 0)
        self._status.setsockopt(zmq.SNDHWM, 64)
        self._internal.connect(self._status, addrs.status)

    def spawn(self, child: Child) -> None:
        env = self.env | child.env | {"PIPESERVE_PROCESS_NAME": child.name.replace("-", " ")}
        child.proc = self.start(child, env)
        log.info("started %s (pid %d)", child.name, child.proc.pid)

    def dead(self) -> list[tuple[Child, int]]:
        return [
            (c, c.proc.returncode) for c in self.children if c.proc is not None and c.proc.poll() is not None
        ]

    def restart(self, child: Child, code: int) -> bool:
        """Restart a child that died; False when it keeps dying."""
        now = time.monotonic()
        child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW] + [now]
        log.warning("%s (pid %d) exited with %d", child.name, child.proc.pid if child.proc else -1, code)
        self._notify(child.name, up=False)
        if len(child.restarts) > MAX_RESTARTS:
            log.error(
                "%s died %d times within %.0f s: giving up", child.name, len(child.restarts), RESTART_WINDOW
            )
            return False
        self.spawn(child)
        self._notify(child.name, up=True)
        return True

    def _notify(self, name: str, up: bool) -> None:
        try:
            self._status.send(encode(ProcessStatus(process=name, up=up)), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("gateway not reachable: %s %s not reported", name, "up" if up else "down")

    def stop(self, grace: float) -> None:
        """The gateway first (it drains its streams within grace), then everything else."""
        gateway = [c for c in self.children if c.name == "gateway"]
        for group, timeout in (
            (gateway, grace + STOP_TIMEOUT),
            ([c for c in self.children if c.name != "gateway"], STOP_TIMEOUT),
        ):
            procs = [c.proc for c in group if c.proc is not None and c.proc.poll() is None]
            for proc in procs:
                proc.terminate()
            deadline = time.monotonic() + timeout
            for proc in procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("pid %d did not stop within %.0f s: killing it", proc.pid, timeout)
                    proc.kill()
                    proc.wait()
        self._internal.close()
        self._zmq.destroy(linger=0)


def plan(
    engine: EngineConfig, gateway: GatewayConfig, workers: int, engines: int = 1, pin: bool = True,
    split: CpuSplit | None = None,
) -> list[Child]:
    """The children: `engines` engines (data parallel; each binds its own requests/control
    endpoint), one detokenizer, the tokenizers and the gateway. On a CPU-only host (pin: the
    children run on this host) the engines get cores of their own (pipeserve/cpus.py), dealt out
    among them: `split`'s (cores claimed host-wide), else this host's split."""
    if split is None and pin:
        split = cpu_split(engine)
    engine_children = []
    others_env: dict[str, str] = {}
    if split is not None:
        others_env = cpus_env(split.others)
        log.info("engines on cores %s, the rest of the pipeline on %s", split.engine, split.others)
    for i in range(engines):
        config, env = engine, {}
        if split is not None:
            cores = engine_core_sets(split, engines)[i]
            config, env = replace(engine, cpu_threads=len(cores)), cpus_env(cores)
        argv = ["engine", *cfg.to_argv(config), "--engine-index", str(i)]
        engine_children.append(Child(f"engine-{i}", argv, env=env))
    tokenizer = cfg.to_argv(engine, only=cfg.TOKENIZER_FIELDS)
    return [
        *engine_children,
        Child("detokenizer", ["detokenizer", *tokenizer], env=others_env),
        *[Child(f"tokenizer-{i}", ["tokenizer", *tokenizer], env=others_env) for i in range(workers)],
        Child("gateway", ["gateway", *cfg.to_argv(gateway), *tokenizer,
                          *cfg.to_argv(engine, only=cfg.LORA_FIELDS)], env=others_env),
    ]


def wait_serving(
    target: str, instance_id: str, supervisor: Supervisor, timeout: float, stopping: list[int],
    **security: Any,
) -> int | None:
    """Poll the gateway's health for its instance id (over TLS when security says so) until SERVING
    (None): only our own gateway knows that id. Otherwise the exit status `up` ends with:
    EXIT_STARTUP when a child found a start-up problem (it printed the one line), else 1."""
    from pipeserve.gateway.client import Client

    deadline = time.monotonic() + timeout
    with Client(target, **security) as client:
        while not stopping:
            if client.health(instance_id, timeout=1.0) == "SERVING":
                return None
            for child, code in supervisor.dead():
                if code == EXIT_STARTUP:
                    log.info("%s could not start: stopping", child.name)
                    return EXIT_STARTUP
                log.error("%s exited with %d during start-up", child.name, code)
                return 1
            if time.monotonic() > deadline:
                hint = ""
                if security.get("tls_root_cert"):
                    name = security["tls_server_name"]
                    hint = f" (checked over TLS for the name {name!r}: see --tls-server-name)"
                log.error("not SERVING after %.0f s%s: raise --startup-timeout if it was still starting",
                          timeout, hint)
                return 1
            time.sleep(0.1)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_arg", nargs="?", metavar="MODEL",
                        help="the model to serve (as --model): a checkpoint directory or a hub id")
    parser.add_argument("--debug", action="store_true",
                        help="a start-up failure prints its traceback too (every process's)")
    parser.add_argument("--tokenizer-workers", type=int, default=2, help="tokenizer processes")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for SERVING")
    cfg.add_arguments(parser, LaunchConfig)
    parser.add_argument(
        "--tls-server-name",
        default="localhost",
        help="with --tls-cert: a name the certificate carries (the start-up health check connects to "
        "the gateway's own address and verifies the certificate for this name)",
    )
    cfg.add_arguments(parser, EngineConfig)
    cfg.add_arguments(parser, GatewayConfig)


def local_tcp(engines: int) -> Addresses:
    """tcp:// endpoints on 127.0.0.1 on ports free now (this host, wired as hosts are across a network)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(5 + 2 * engines)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        ports = [f"tcp://127.0.0.1:{sock.getsockname()[1]}" for sock in sockets]
    named = dict(zip(("tokenize", "steps", "deltas", "errors", "status"), ports, strict=False))
    return Addresses(**named, requests=",".join(ports[5:5 + engines]), control=",".join(ports[5 + engines:]))


@dataclass
class Running:
    supervisor: Supervisor
    target: str  # host:port of the gateway, for clients on this host
    where: str  # the ipc sockets' directory, or the Ray cluster
    serving: bool  # the gateway said SERVING before the start-up timeout (or a signal)
    code: int = 0  # when not serving: the exit status (EXIT_STARTUP: a child printed why)


@contextlib.contextmanager
def running(
    engine: EngineConfig,
    gateway: GatewayConfig,
    workers: int,
    startup_timeout: float,
    stopping: list[int],
    security: dict[str, Any] | None = None,
    engine_argv: list[str] | None = None,
    engines: int = 1,
    ray: str | None = None,
    debug: bool = False,
    zmq_over: str = "ipc",
    zmq_key_file: str | None = None,
) -> Iterator[Running]:
    """Start every child and wait for SERVING; on exit stop them in order (the gateway first, within
    gateway.grace). On this host the children are wired through a private run dir (removed at the
    end); with `ray` (a cluster address) they are placed on its nodes (pipeserve/ray_launcher.py).
    engine_argv replaces the engine's subcommand (a benchmark's synthetic engine; one engine only).
    engines: data parallel size. debug: children print a start-up failure's traceback. zmq_over "tcp":
    wire them over tcp:// on 127.0.0.1 instead (as across hosts: CURVE, see pipeserve/zmq_auth.py;
    "tcp-insecure" without it, to measure its cost). Over tcp:// (and under Ray) the children share
    zmq_key_file's key pair, or one made for this start."""
    with contextlib.ExitStack() as stack:
        # On this host the engines' cores are claimed host-wide for as long as this launcher runs.
        split = stack.enter_context(claim_split(engine)) if ray is None else None
        children = plan(engine, gateway, workers, engines, pin=False, split=split)
        if engine_argv is not None:
            assert engines == 1, "a replaced engine runs alone"
            children[0].argv = engine_argv
        elif debug:
            for child in children:
                if child.argv[0] == "engine":
                    child.argv.append("--debug")
        instance_id = new_instance_id()
        children[-1].env["PIPESERVE_INSTANCE_ID"] = instance_id
        run_dir = tempfile.mkdtemp(prefix="pipeserve-")  # mode 0700: the ipc sockets, the generated key
        stack.callback(shutil.rmtree, run_dir, ignore_errors=True)
        key_file, tcp = None, zmq_over.startswith("tcp")
        if ray is not None or zmq_over == "tcp":
            key_file = zmq_key_file or os.path.join(run_dir, "zmq.key")
            if zmq_key_file is None:
                generate(key_file)
            log.info("internal ZeroMQ over tcp://: CURVE with the key pair in %s (%s)", key_file,
                     "given" if zmq_key_file else "made for this start")
        if ray is None:
            start: Starter = start_local
            addrs = local_tcp(engines) if tcp else Addresses.under(run_dir, engines)
            where = "tcp://127.0.0.1" if tcp else run_dir
            env = {**os.environ, "PIPESERVE_PARENT_PID": str(os.getpid())}
            env |= InternalAuth(key_file, insecure=zmq_over == "tcp-insecure").to_env()
        else:
            from pipeserve import ray_launcher

            assert key_file is not None
            key = Path(key_file).read_text()  # written on each node by its actor, for its children
            addrs, start = stack.enter_context(ray_launcher.placed(ray, children, engine, engines, key))
            where, env = f"ray {ray}", {}  # each node's actor adds its own environment
        env |= {**addrs.to_env(), "PIPESERVE_MODEL": str(engine.model)}
        supervisor = Supervisor(children, addrs, env, start, key_file)
        host = "127.0.0.1" if gateway.host in ("0.0.0.0", "::", "") else gateway.host
        target = f"{host}:{gateway.port}"
        try:
            for child in supervisor.children:
                supervisor.spawn(child)
            code = wait_serving(target, instance_id, supervisor, startup_timeout, stopping,
                                **(security or {}))
            yield Running(supervisor, target, where, code is None, code or 0)
        finally:
            supervisor.stop(gateway.grace)


def configs(args: argparse.Namespace) -> tuple[EngineConfig, GatewayConfig]:
    """The configs `up` serves, every start-up check passed (StartupError otherwise)."""
    if args.tokenizer_workers < 1:
        raise StartupError(f"--tokenizer-workers must be >= 1, got {args.tokenizer_workers}")
    if args.startup_timeout <= 0:
        raise StartupError(f"--startup-timeout must be > 0 seconds, got {args.startup_timeout}")
    model = getattr(args, "model_arg", None)
    if model is None and args.model is None and getattr(args, "prog", "").endswith(" serve"):
        raise StartupError("give the model to serve: pipeserve serve MODEL (a checkpoint directory or a "
                           "hub id; `pipeserve up` alone serves the random-weight demo model)")
    if model is not None:
        if args.model is not None and args.model != model:
            raise StartupError(f"the model is given twice ({model} and --model {args.model}): give one")
        args.model = model
    if args.http_port is None:
        args.http_port = DEFAULT_HTTP_PORT
    engine, gateway = cfg.from_args(EngineConfig, args), cfg.from_args(GatewayConfig, args)
    for flag, path in (("--tls-cert", gateway.tls_cert), ("--tls-key", gateway.tls_key)):
        if path is not None and not os.path.isfile(path):
            raise StartupError(f"{flag} {path}: no such file")
    check_ports(gateway)
    if engine.model and os.path.isdir(engine.model):
        engine = replace(engine, model=os.path.abspath(engine.model))
    return preflight.run(engine, getattr(args, "debug", False)), gateway


def endpoints(gateway: GatewayConfig) -> str:
    """Every endpoint a server listens on, as clients on this host reach them."""
    host = "127.0.0.1" if gateway.host in ("0.0.0.0", "::", "") else gateway.host
    parts = [f"gRPC {host}:{gateway.port}" + (" (TLS)" if gateway.tls_cert else "")]
    if gateway.http_port is not None:
        parts.append(f"OpenAI HTTP http://{host}:{gateway.http_port}/v1 (metrics at /metrics)")
    if gateway.metrics_port is not None:
        parts.append(f"metrics http://{host}:{gateway.metrics_port}/metrics")
    return ", ".join(parts)


def launch_config(args: argparse.Namespace) -> LaunchConfig:
    launch: LaunchConfig = cfg.from_args(LaunchConfig, args)
    if launch.ray and importlib.util.find_spec("ray") is None:
        raise StartupError("--ray needs Ray: pip install 'pipeserve[ray]'")
    return launch


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    set_title("up")
    try:
        launch = launch_config(args)
        engine, gateway = configs(args)
    except StartupError as exc:
        return fail(getattr(args, "prog", "pipeserve up"), exc, args.debug)
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    # The gateway serves TLS only: the health check must speak it too, trusting the served certificate.
    security = (
        {"tls_root_cert": gateway.tls_cert, "tls_server_name": args.tls_server_name}
        if gateway.tls_cert
        else {}
    )
    code = 1
    with running(engine, gateway, args.tokenizer_workers, args.startup_timeout, stopping, security,
                 engines=launch.data_parallel_size, ray=launch.ray, debug=args.debug,
                 zmq_key_file=launch.zmq_key_file, zmq_over=launch.zmq_over) as up:
        code = up.code or 1
        if up.serving:
            log.info("serving %s: %s (sockets: %s)", engine.served_model_name or engine.model,
                     endpoints(gateway), up.where)
            code = 0
            while not stopping:
                for child, status in up.supervisor.dead():
                    if not up.supervisor.restart(child, status):
                        stopping.append(0)
                        code = 1
                time.sleep(0.1)
        if stopping and stopping[0]:  # a signal, not a give-up
            log.info("%s: shutting down", signal.Signals(stopping[0]).name)
            code = 0
    return code
