"""compose.yaml validated by `docker-compose config`, and checked for what the deployment promises:
the ZeroMQ wiring pairs every binder with its connectors, only the gateway is published, the engine
reserves a GPU, the model is mounted read-only, and every command parses with the real CLI."""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.cli import COMMANDS

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


@pytest.fixture(scope="module")
def compose(tmp_path_factory) -> dict:
    model = tmp_path_factory.mktemp("model")
    env = {**os.environ, "MODEL_DIR": str(model)}
    out = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "compose.yaml"), "config"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    config["model_dir"] = str(model)
    return config


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
    assert [p["target"] for p in published["gateway"]] == [50051]
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


def test_engine_reserves_a_gpu_and_the_model_is_read_only(compose):
    devices = compose["services"]["engine"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)
    for name in ("tokenizer", "engine", "detokenizer"):
        (volume,) = compose["services"][name]["volumes"]
        assert (volume["source"], volume["target"], volume["read_only"]) == (
            compose["model_dir"],
            "/model",
            True,
        )
    assert "volumes" not in compose["services"]["gateway"]


def test_healthchecks(compose):
    for name in ("gateway", "engine", "detokenizer"):
        test = compose["services"][name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "services.gateway.healthcheck"], name
    assert compose["services"]["gateway"]["healthcheck"]["test"][4:] == ["grpc", "127.0.0.1:50051"]


def test_commands_parse_with_the_real_cli(compose):
    for name, service in compose["services"].items():
        command, *argv = service["command"]
        module = importlib.import_module(COMMANDS[command][0])
        parser = argparse.ArgumentParser(prog=command)
        module.add_arguments(parser)
        args = parser.parse_args(argv)
        assert getattr(args, "model", "/model") == "/model", name
