"""pipeserve/cpus.py: the engine's own cores on a CPU-only host, and children pinned from the env."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeserve.config import EngineConfig, GatewayConfig
from pipeserve.cpus import ENV, CpuSplit, cpu_split
from pipeserve.launcher import plan

pytestmark = pytest.mark.timeout(60)


def test_split_gives_the_engine_all_cores_but_one():
    cpu = EngineConfig(device="cpu")
    assert cpu_split(cpu, {0, 1}) == CpuSplit(engine=(1,), others=(0,))
    assert cpu_split(cpu, {2, 5, 7, 9}) == CpuSplit(engine=(5, 7, 9), others=(2,))
    two = EngineConfig(device="cpu", cpu_threads=2)
    assert cpu_split(two, set(range(8))) == CpuSplit((6, 7), (0, 1, 2, 3, 4, 5))
    assert cpu_split(EngineConfig(device="cpu", cpu_threads=64), set(range(4))) == CpuSplit((1, 2, 3), (0,))
    assert cpu_split(cpu, {3}) is None  # one core: nothing to split
    assert cpu_split(EngineConfig(device="cuda"), set(range(16))) is None


def test_plan_pins_children_and_sizes_the_engine_threads(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1, 2})
    children = plan(EngineConfig(model="m", device="cpu"), GatewayConfig(), workers=2)
    envs = {c.name: c.env for c in children}
    assert envs["engine-0"] == {ENV: "1,2"}
    assert all(envs[n] == {ENV: "0"} for n in ("gateway", "detokenizer", "tokenizer-0", "tokenizer-1"))
    engine = next(c for c in children if c.name == "engine-0")
    assert engine.argv[engine.argv.index("--cpu-threads") + 1] == "2"
    assert all(c.env == {} for c in plan(EngineConfig(model="m", device="cuda"), GatewayConfig(), workers=1))


def test_a_child_pins_itself_before_anything_else():
    code = "import os, pipeserve.cpus as c; c.apply_from_env(); print(sorted(os.sched_getaffinity(0)))"
    first = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", code], env=os.environ | {ENV: str(first)},
                         capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.strip() == f"[{first}]"
