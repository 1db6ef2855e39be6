"""`pipeserve up --ray ADDRESS`: the processes of `pipeserve up`, placed on the nodes of a Ray cluster.

Each process runs under a small Ray actor (`Host`) on the node Ray placed it on; the actor starts
the very same child as the local launcher (pipeserve/child.py CHILD: parent-death signal, process
title, the ordinary CLI), so the process dies with its actor, and the launcher's Supervisor watches
and restarts it through the actor (a `RemoteProc`), on the same node.

Placement:
- each engine gets a placement group of T bundles (T = the engine's tensor parallel size, 1
  without tensor parallelism), one CPU each and one GPU each on a GPU cluster, STRICT_PACK on one
  node; the data-parallel engines are spread over the nodes: engine i goes to a node with room
  for its T bundles that holds the fewest engines so far, pinned by the node-id label Ray gives every
  node;
- the gateway runs on the node that runs `up` (clients reach it where they started it), the
  detokenizer where Ray finds CPU, the tokenizers spread over the nodes; each takes a quarter CPU
  (their work is light and they must fit beside the engines).
The processes talk over ZeroMQ on tcp:// endpoints at their nodes' addresses, on ports each binder's
actor found free on its own node. A node that is lost takes its processes with it: the launcher
then gives up (the restarted process would need new addresses for every peer).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeserve.child import CHILD, Child, Proc, Starter
from pipeserve.config import Addresses, EngineConfig, InternalAuth
from pipeserve.preflight import StartupError

log = logging.getLogger("pipeserve.ray")

NODE_LABEL = "ray.io/node-id"
LIGHT_CPU = 0.25  # tokenizers, detokenizer, gateway
READY_TIMEOUT = 120.0  # seconds for a placement group or an actor to come up
CALL_TIMEOUT = 30.0


class Host:
    """A Ray actor that runs one pipeserve process on its node."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.key_file: str | None = None

    def node(self) -> tuple[str, str]:
        """(node id, node IP address)."""
        import ray

        ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return ray.get_runtime_context().get_node_id(), ip

    def free_ports(self, count: int) -> list[int]:
        """Ports free on this node right now (held together, so they differ)."""
        with contextlib.ExitStack() as stack:
            sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
            for sock in sockets:
                sock.bind(("", 0))
            return [sock.getsockname()[1] for sock in sockets]

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]

    def start(self, argv: list[str], env: dict[str, str], key: str) -> int:
        # The child checks its parent is this actor's process (child.child_main).
        full = os.environ | env | {"PIPESERVE_PARENT_PID": str(os.getpid())}
        # The deployment's ZeroMQ key pair, in a file of this node only its user may read (once per
        # actor: a restarted child finds it again).
        if self.key_file is None:
            self.key_file = os.path.join(tempfile.mkdtemp(prefix="pipeserve-key-"), "zmq.key")
            fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(key)
        full |= InternalAuth(self.key_file).to_env()
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, *argv], env=full, start_new_session=True)
        return self.proc.pid

    def poll(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()

    def signal(self, kill: bool) -> None:
        assert self.proc is not None
        self.proc.kill() if kill else self.proc.terminate()

    def wait(self, timeout: float | None) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class RemoteProc:
    """A child on a Ray node, seen through its Host actor as a subprocess.Popen (child.Proc)."""

    def __init__(self, host: Any, pid: int) -> None:
        self.host, self.pid = host, pid
        self.returncode: int | None = None

    def _call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        import ray

        return ray.get(getattr(self.host, method).remote(*args), timeout=timeout)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self._call("poll")
            except Exception as exc:  # the actor (or its node) is gone: so is the process
                log.error("the actor of pid %d is gone: %s", self.pid, exc)
                self.returncode = -1
        return self.returncode

    def terminate(self) -> None:
        self._call("signal", False)

    def kill(self) -> None:
        self._call("signal", True)

    def wait(self, timeout: float | None = None) -> int:
        code = self._call("wait", timeout, timeout=(timeout or 0) + CALL_TIMEOUT)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        self.returncode = code
        return int(code)


@dataclass
class Placement:
    hosts: dict[str, Any]  # child name -> its Host actor
    nodes: dict[str, tuple[str, str]]  # child name -> (node id, IP)
    addrs: Addresses
    groups: list[Any]  # the engines' placement groups
    gpus: dict[str, str]  # engine child name -> CUDA_VISIBLE_DEVICES over its T bundles


def engine_bundle(engine: EngineConfig, nodes: list[dict[str, Any]]) -> dict[str, float]:
    """One rank's bundle: a CPU, and a GPU when the engine runs on CUDA (auto: the cluster has GPUs)."""
    has_gpu = any(node["Resources"].get("GPU", 0) > 0 for node in nodes)
    gpu = engine.device.startswith("cuda") or (engine.device == "auto" and has_gpu)
    return {"CPU": 1.0, "GPU": 1.0} if gpu else {"CPU": 1.0}


def engine_nodes(
    nodes: list[dict[str, Any]], bundle: dict[str, float], ranks: int, engines: int
) -> list[str]:
    """The node of each engine: one with room for its ranks' bundles, holding the fewest engines so
    far (the first such node in Ray's order on a tie)."""
    free = {node["NodeID"]: dict(node["Resources"]) for node in nodes}
    count = dict.fromkeys(free, 0)
    chosen = []
    for i in range(engines):
        fits = [n for n, res in free.items() if all(res.get(k, 0.0) >= v * ranks for k, v in bundle.items())]
        if not fits:
            raise StartupError(f"no Ray node has room for engine {i}: {ranks} x {bundle} (nodes: {free})")
        node = min(fits, key=lambda n: count[n])
        for k, v in bundle.items():
            free[node][k] -= v * ranks
        count[node] += 1
        chosen.append(node)
    return chosen


def place(children: list[Child], engine: EngineConfig, engines: int) -> Placement:
    """Placement groups and Host actors for every child; the tcp:// addresses they bind and connect."""
    import ray
    from ray.util import placement_group
    from ray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )

    actor: Any = ray.remote(Host)
    every: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    nodes = [node for node in every if node["Alive"]]
    bundle = engine_bundle(engine, nodes)
    ranks = engine.tensor_parallel_size
    hosts: dict[str, Any] = {}
    groups, gpus = [], {}
    for i, node in enumerate(engine_nodes(nodes, bundle, ranks, engines)):
        group = placement_group([bundle] * ranks, strategy="STRICT_PACK", name=f"pipeserve-engine-{i}",
                                bundle_label_selector=[{NODE_LABEL: node}] * ranks)
        ray.get(group.ready(), timeout=READY_TIMEOUT)
        groups.append(group)
        in_group = [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=b)
                    for b in range(ranks)]
        hosts[f"engine-{i}"] = actor.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0), scheduling_strategy=in_group[0]).remote()
        if "GPU" in bundle:  # every rank's GPU, for the engine's own tensor-parallel workers
            probes: list[Any] = [actor.options(num_cpus=0, num_gpus=1, scheduling_strategy=strategy).remote()
                      for strategy in in_group[1:]]
            ids = ray.get([hosts[f"engine-{i}"].gpu_ids.remote(), *[p.gpu_ids.remote() for p in probes]],
                          timeout=READY_TIMEOUT)
            gpus[f"engine-{i}"] = ",".join(gpu for rank in ids for gpu in rank)
            for probe in probes:
                ray.kill(probe)
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    for child in children:
        if child.name == "gateway":
            hosts[child.name] = actor.options(num_cpus=LIGHT_CPU, scheduling_strategy=here).remote()
        elif child.name.startswith("tokenizer"):
            hosts[child.name] = actor.options(num_cpus=LIGHT_CPU, scheduling_strategy="SPREAD").remote()
        elif child.name not in hosts:
            hosts[child.name] = actor.options(num_cpus=LIGHT_CPU).remote()
    where = dict(zip(hosts, ray.get([h.node.remote() for h in hosts.values()], timeout=READY_TIMEOUT),
                     strict=True))

    # Every binder's ports, asked of one host per IP address in one call (held together, so they
    # differ): nodes that share an address (several on one machine) must not be given the same port.
    binders = [("gateway", 4), *((f"engine-{i}", 2) for i in range(engines)), ("detokenizer", 1)]
    wanted: dict[str, int] = {}
    for name, count in binders:
        wanted[where[name][1]] = wanted.get(where[name][1], 0) + count
    asker = {where[name][1]: hosts[name] for name, _ in binders}
    ports = dict(zip(wanted, ray.get([asker[ip].free_ports.remote(n) for ip, n in wanted.items()],
                                     timeout=CALL_TIMEOUT), strict=True))

    def endpoints(name: str, count: int) -> list[str]:
        ip = where[name][1]
        taken, ports[ip] = ports[ip][:count], ports[ip][count:]
        return [f"tcp://{ip}:{port}" for port in taken]

    tokenize, deltas, errors, status = endpoints("gateway", 4)
    per_engine = [endpoints(f"engine-{i}", 2) for i in range(engines)]
    addrs = Addresses(tokenize=tokenize, deltas=deltas, errors=errors, status=status,
                      requests=",".join(e[0] for e in per_engine), control=",".join(e[1] for e in per_engine),
                      steps=endpoints("detokenizer", 1)[0])
    for name, (node, ip) in where.items():
        log.info("%s on node %s (%s)", name, node, ip)
    return Placement(hosts, where, addrs, groups, gpus)


@contextlib.contextmanager
def placed(
    address: str, children: list[Child], engine: EngineConfig, engines: int, key: str
) -> Iterator[tuple[Addresses, Starter]]:
    """Connect to the cluster and place every child (each child's env gains its node, and an
    engine's its GPUs); yields the addresses and how to start a child on its node, with key (the
    deployment's ZeroMQ key pair, pipeserve/zmq_auth.py) in a private file there. On exit the actors
    (their processes with them) and placement groups are released."""
    import ray

    ray.init(address=address, log_to_driver=True)
    try:
        placement = place(children, engine, engines)
        for child in children:
            child.env["PIPESERVE_RAY_NODE"] = placement.nodes[child.name][0]  # for `ps e` and the tests
            if child.name in placement.gpus:
                child.env["CUDA_VISIBLE_DEVICES"] = placement.gpus[child.name]

        def start(child: Child, env: dict[str, str]) -> Proc:
            host = placement.hosts[child.name]
            return RemoteProc(host, ray.get(host.start.remote(child.argv, env, key), timeout=CALL_TIMEOUT))

        try:
            yield placement.addrs, start
        finally:
            for actor in placement.hosts.values():
                ray.kill(actor)
            for group in placement.groups:
                ray.util.remove_placement_group(group)
    finally:
        ray.shutdown()
