"""`pipeserve up --ray` on a local two-node Ray cluster (ray.cluster_utils, both nodes on this host,
each with its own custom resource): two data-parallel engines, one per node, serve a stream through
the gateway; every process is found where the launcher's placement put it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeserve.gateway.client import Completion
from pipeserve.local_cluster import LocalCluster
from tests.conftest import STORIES
from tests.test_pipeline import stream_all

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'pipeserve[ray]')")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not (STORIES / "config.json").is_file(), reason=f"stories260K not found at {STORIES}"),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[str, dict[str, str]]]:
    """The cluster's address and its node ids by custom resource ("a": the head, "b": the other)."""
    from ray.cluster_utils import Cluster

    small = {"object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"a": 1},
                                                            "include_dashboard": False, **small})
    cluster.add_node(num_cpus=2, resources={"b": 1}, **small)
    cluster.wait_for_nodes()
    try:
        ray.init(address=cluster.address)
        nodes = {name: node["NodeID"] for node in ray.nodes() if node["Alive"]
                 for name in ("a", "b") if name in node["Resources"]}
        ray.shutdown()
        yield cluster.address, nodes
    finally:
        cluster.shutdown()


def pipeserve_processes() -> dict[str, str]:
    """Process title ("engine 0", "gateway", ...) -> the Ray node its launcher placed it on."""
    out = {}
    for proc in Path("/proc").iterdir():
        try:
            # Bytes, decoded leniently: one undecodable variable must not hide a process.
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
            items = (proc / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        environ = dict(item.split("=", 1) for item in items if "=" in item)
        if title.startswith("pipeserve: ") and "PIPESERVE_RAY_NODE" in environ:
            out[title.removeprefix("pipeserve: ")] = environ["PIPESERVE_RAY_NODE"]
    return out


def test_two_engines_one_per_node_serve_a_stream(cluster, tmp_path) -> None:
    address, nodes = cluster
    flags = ("--ray", address, "--data-parallel-size", "2", "--cpu-threads", "1")
    with LocalCluster(tmp_path / "up.log", str(STORIES), *flags, workers=1, startup=240) as srv:
        srv.wait_engines(2)
        # Enough tokens that the stream comes in several messages (a short one may arrive coalesced).
        chunks = list(srv.client.stream("Once upon a time", max_tokens=96, temperature=0, ignore_eos=True))
        assert len(chunks) > 1 and chunks[-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in chunks) == 96
        info = srv.client.model_info()
        assert (info.data_parallel_size, [e.serving for e in info.engines]) == (2, [True, True])
        results = asyncio.run(stream_all(srv.target, [{"prompt": f"Tom had {i}", "max_tokens": 4}
                                                      for i in range(6)]))
        assert all(isinstance(r, Completion) and r.completion_tokens == 4 for r in results)
        metrics = srv.metrics()
        assert all(metrics[f'pipeserve_gateway_routed_requests_total{{engine="{i}"}}'] >= 1 for i in (0, 1))
        expected = {"engine 0", "engine 1", "detokenizer", "tokenizer 0", "gateway"}
        deadline = time.monotonic() + 15
        while set(placed := pipeserve_processes()) != expected and time.monotonic() < deadline:
            time.sleep(0.5)  # a scan of /proc once missed two live processes: look again
        assert set(placed) == expected, placed
        assert {placed["engine 0"], placed["engine 1"]} == set(nodes.values())  # one engine per node
        assert placed["gateway"] in nodes.values() and placed["detokenizer"] in nodes.values()
        assert "on node" in srv.tail(400)  # the launcher logged where each process went
