"""compose.yaml validated by `docker-compose config`, and checked for what the deployment promises:
the ZeroMQ wiring pairs every binder with its connectors, only the gateway is published, the engine
gets a GPU (none with compose.cpu.yaml), the model is mounted read-only, and every command parses
with the real CLI; then the CPU deployment is built and really run."""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import yaml

from pipeserve.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
BINDERS = {
    "tokenize": "gateway",
    "deltas": "gateway",
    "errors": "gateway",
    "status": "gateway",
    "requests": "engine",
    "control": "engine",
    "steps": "detokenizer",
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        shutil.which("docker-compose") is None,
        reason="docker-compose not installed (`make test` installs the Debian package)",
    ),
]


def compose_config(model: Path, *files: str) -> dict:
    key = model.parent / "zmq.key"
    key.write_text("unused by `config`")
    env = {**os.environ, "MODEL_DIR": str(model), "ZMQ_KEY_FILE": str(key)}
    out = subprocess.run(
        ["docker-compose", *[arg for name in files for arg in ("-f", str(ROOT / name))], "config"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    config: dict = yaml.safe_load(out.stdout)
    config["model_dir"] = str(model)
    return config


@pytest.fixture(scope="module")
def compose(tmp_path_factory) -> dict:
    return compose_config(tmp_path_factory.mktemp("model"), "compose.yaml")


def test_the_cpu_override_runs_the_engine_on_the_cpu_without_a_gpu(tmp_path) -> None:
    config = compose_config(tmp_path, "compose.yaml", "compose.cpu.yaml")
    engine = config["services"]["engine"]
    assert engine["command"][-2:] == ["--device", "cpu"] and engine["runtime"] == "runc"
    base = compose_config(tmp_path, "compose.yaml")["services"]
    for name in ("gateway", "tokenizer", "detokenizer"):  # only the engine changes
        assert config["services"][name]["command"] == base[name]["command"], name
        assert config["services"][name].get("runtime") == base[name].get("runtime") is None, name


def test_services_and_networks(compose):
    services = compose["services"]
    assert set(services) == {"gateway", "tokenizer", "engine", "detokenizer"}
    assert compose["networks"]["pipeline"]["internal"] is True
    for name, service in services.items():
        assert "pipeline" in service["networks"], name
    assert "container_name" not in services["tokenizer"]  # `--scale tokenizer=N` needs that


def test_only_the_gateway_port_is_published(compose):
    published = {name: s.get("ports") for name, s in compose["services"].items() if s.get("ports")}
    assert list(published) == ["gateway"]
    assert [p["target"] for p in published["gateway"]] == [50051, 8000]  # gRPC, the OpenAI HTTP API
    assert set(compose["services"]["gateway"]["networks"]) == {"pipeline", "public"}


def test_zeromq_wiring_pairs_binders_and_connectors(compose):
    seen = dict.fromkeys(BINDERS, 0)
    ports = {}
    for name, service in compose["services"].items():
        for key, addr in service.get("environment", {}).items():
            kind = key.removeprefix("PIPESERVE_").removesuffix("_ADDR").lower()
            if kind not in BINDERS:
                continue
            seen[kind] += 1
            scheme, _, hostport = addr.partition("://")
            host, _, port = hostport.rpartition(":")
            assert scheme == "tcp", addr
            assert host == ("*" if BINDERS[kind] == name else BINDERS[kind]), (name, key, addr)
            assert ports.setdefault(kind, port) == port, f"{kind} on two ports"
    assert all(count >= 2 for count in seen.values()), seen  # a binder and at least one connector
    assert len(set(ports.values())) == len(ports)


def test_every_process_holds_the_zeromq_key(compose):
    """tcp:// binders refuse to start without it, and peers without it are refused (zmq_auth.py)."""
    assert compose["secrets"]["zmq_key"]["file"].endswith("zmq.key")
    for name, service in compose["services"].items():
        assert service["environment"]["PIPESERVE_ZMQ_KEY_FILE"] == "/run/secrets/zmq_key", name
        assert [s["source"] if isinstance(s, dict) else s for s in service["secrets"]] == ["zmq_key"], name


def test_engine_gets_a_gpu_and_the_model_is_read_only(compose):
    engine = compose["services"]["engine"]
    assert engine["runtime"] == "nvidia" and engine["environment"]["NVIDIA_VISIBLE_DEVICES"] == "0"
    assert engine["command"][-2:] == ["--device", "cuda"]
    # The gateway reads only the tokenizer (HTTP /tokenize and /detokenize), from the same mount.
    for name in ("tokenizer", "engine", "detokenizer", "gateway"):
        volume, *others = compose["services"][name]["volumes"]
        assert (volume["source"], volume["target"], volume["read_only"]) == (
            compose["model_dir"],
            "/model",
            True,
        )
        # The engine's compiler caches on a named volume, where the image's PIPESERVE_CACHE points.
        assert others == (["cache:/home/pipeserve/.cache/pipeserve:rw"] if name == "engine" else [])
    assert "PIPESERVE_CACHE=/home/pipeserve/.cache/pipeserve" in (ROOT / "Dockerfile").read_text()
    assert set(compose["volumes"]) == {"cache"}
    # Triton's kernel cache too (Inductor's follows PIPESERVE_CACHE by itself).
    triton_cache = compose["services"]["engine"]["environment"]["TRITON_CACHE_DIR"]
    assert triton_cache.startswith("/home/pipeserve/.cache/pipeserve/"), triton_cache


def test_the_image_exposes_both_apis() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    exposed = [line.split()[1:] for line in dockerfile.splitlines() if line.startswith("EXPOSE")]
    assert exposed == [["50051", "8000"]]
    assert "-p 50051:50051 -p 8000:8000" in dockerfile  # the `docker run` example publishes both


def test_healthchecks(compose):
    for name in ("gateway", "engine", "detokenizer"):
        test = compose["services"][name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "pipeserve.gateway.healthcheck"], name
    assert compose["services"]["gateway"]["healthcheck"]["test"][4:] == ["grpc", "127.0.0.1:50051"]


def test_commands_parse_with_the_real_cli(compose):
    for name, service in compose["services"].items():
        command, *argv = service["command"]
        module = importlib.import_module(COMMANDS[command][0])
        parser = argparse.ArgumentParser(prog=command)
        module.add_arguments(parser)
        args = parser.parse_args(argv)
        assert getattr(args, "model", "/model") == "/model", name


# ---- the deployment, really run (CPU) -------------------------------------------------------
@pytest.mark.timeout(1200)
def test_compose_cpu_deployment_really_runs(tmp_path, stories_dir) -> None:
    """Build the image, `up --scale tokenizer=3` with stories260K, stream a greedy request through the
    published port, see all three tokenizers serve, SIGKILL the engine and see it restart and serve
    again; `down` leaves nothing."""
    from pipeserve.gateway.client import Client
    from pipeserve.local_cluster import free_port
    from tests import docker_env

    problem = docker_env.docker_problem()
    if problem:
        pytest.skip(problem)
    docker_env.build_image(ROOT, "pipeserve:latest")
    port = free_port()
    project = f"pipeserve-test-{os.getpid()}"
    # Test-only: the tokenizers log every request, so the test can see which served.
    verbose = tmp_path / "compose.verbose.yaml"
    verbose.write_text('services:\n  tokenizer:\n    command: ["tokenizer", "--model", "/model", '
                       '"--log-level", "debug"]\n')
    compose = ["docker-compose", "-p", project, "-f", str(ROOT / "compose.yaml"),
               "-f", str(ROOT / "compose.cpu.yaml"), "-f", str(verbose)]
    from pipeserve.zmq_auth import generate

    key = tmp_path / "zmq.key"
    generate(str(key))
    key.chmod(0o644)  # the image's user (uid 1000) reads it; a real deployment chowns it instead
    env = {**os.environ, "MODEL_DIR": stories_dir, "PIPESERVE_PORT": str(port), "ZMQ_KEY_FILE": str(key)}

    def dc(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        out = subprocess.run([*compose, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=timeout)
        assert out.returncode == 0, f"docker-compose {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
        return out

    def serving(client: Client, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while client.health(timeout=2) != "SERVING":
            assert time.monotonic() < deadline, dc("logs", "--tail", "30").stdout
            time.sleep(1)

    expected = ", there was a little girl"  # stories260K's greedy continuation (tests/test_pipeline.py)
    try:
        dc("up", "-d", "--no-build", "--scale", "tokenizer=3")
        with Client(f"127.0.0.1:{port}") as client:
            serving(client, 300)
            chunks = client.stream("Once upon a time", max_tokens=16, temperature=0)
            streamed = "".join(c.text for c in chunks)
            assert streamed.startswith(expected), streamed
            for i in range(30):
                client.generate(f"Lily had {i} red balls.", max_tokens=2)
            logs = dc("logs", "--no-color", "tokenizer").stdout
            served_by = {line.split("|")[0].strip() for line in logs.splitlines() if "tokenized" in line}
            assert len(served_by) == 3, served_by
            engine = dc("ps", "-q", "engine").stdout.split()[0]
            pid = int(subprocess.check_output(["docker", "inspect", "-f", "{{.State.Pid}}", engine],
                                              text=True))
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while int(subprocess.check_output(
                    ["docker", "inspect", "-f", "{{.RestartCount}}", engine], text=True)) < 1:
                assert time.monotonic() < deadline, "the engine container was not restarted"
                time.sleep(1)
            serving(client, 180)
            deadline = time.monotonic() + 120
            while True:  # calls in flight while the gateway learns of the restart end UNAVAILABLE
                try:
                    again = client.generate("Once upon a time", max_tokens=16, temperature=0, timeout=30).text
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, dc("logs", "--tail", "30").stdout
                    time.sleep(1)
            assert again == streamed
    finally:
        subprocess.run([*compose, "down", "-v", "--remove-orphans", "-t", "5"], env=env, cwd=ROOT,
                       capture_output=True, timeout=300)
    left = subprocess.check_output(
        ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"], text=True)
    assert left.split() == []
