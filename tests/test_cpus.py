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


def test_engines_claim_cores_no_other_engine_on_the_host_holds(tmp_path, caplog):
    """Two launchers on one host: the second engine gets the cores the first does not hold, and none
    left means unpinned (said in the log); a claim ends with its holder, even one that was killed."""
    from pipeserve.cpus import claim_split

    cpu = EngineConfig(device="cpu", cpu_threads=2)
    cores = {0, 1, 2, 3, 4}
    with claim_split(cpu, tmp_path, cores) as first:
        assert first == CpuSplit(engine=(3, 4), others=(0, 1, 2))
        with claim_split(cpu, tmp_path, cores) as second:
            assert second == CpuSplit(engine=(1, 2), others=(0, 3, 4))
            caplog.set_level("WARNING", logger="pipeserve.cpus")
            with claim_split(cpu, tmp_path, cores) as third:
                assert third == CpuSplit(engine=(0,), others=(1, 2, 3, 4))
                assert "cores [1, 2, 3, 4] are held by other pipeserve engines" in caplog.text
                with claim_split(cpu, tmp_path, cores) as fourth:
                    assert fourth is None
                    assert "this engine runs unpinned" in caplog.text
    with claim_split(cpu, tmp_path, cores) as again:  # every claim above was released
        assert again == first
    # Another process's claim (a launcher) holds until that process dies.
    hold = ("import sys, time, pathlib; from pipeserve.cpus import claim_split; "
            "from pipeserve.config import EngineConfig; "
            "c = claim_split(EngineConfig(device='cpu', cpu_threads=2), pathlib.Path(sys.argv[1]), "
            "{0, 1, 2, 3, 4}); print(c.__enter__().engine, flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "(3, 4)"
        with claim_split(cpu, tmp_path, cores) as split:
            assert split is not None and split.engine == (1, 2)
    finally:
        holder.kill()
        holder.wait()
    with claim_split(cpu, tmp_path, cores) as split:
        assert split is not None and split.engine == (3, 4)


def test_a_gpu_engine_claims_nothing(tmp_path):
    from pipeserve.cpus import claim_split

    with claim_split(EngineConfig(device="cuda"), tmp_path, {0, 1}) as split:
        assert split is None
    assert list(tmp_path.iterdir()) == []
