"""The vLLM-CPU peer of the benchmarks without vLLM: its worker script and client run against a stub
`vllm` (and `torch`) in a real venv of their own, so the protocol, the environment the worker gets,
its error path and the way `bench step` and `bench offline` use it are the real code. The presets
and the figures `bench step` derives are checked by hand. A run against the real vLLM-CPU, when its
venv is set up here, is the slow test at the end."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeserve.bench import offline, presets, step, vllm_peer
from pipeserve.bench.shapes import LLAMA_76M_V512

pytestmark = pytest.mark.timeout(300)

STUB_VLLM = '''
import http.client  # the standard library's: the worker must not see pipeserve/bench/http.py
import os

__version__ = "stub"


class SamplingParams:
    def __init__(self, max_tokens, **kwargs):
        self.max_tokens = max_tokens
        self.kwargs = kwargs


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Output:
    def __init__(self, rid, token_ids):
        self.request_id = rid
        self.outputs = [_Completion(token_ids)]


class _Engine:
    """One token per request per step; token k of a prompt is (sum(prompt) + k) % 97."""

    def __init__(self):
        self.requests = {}

    def add_request(self, rid, prompt, params):
        self.requests[rid] = (prompt["prompt_token_ids"], params.max_tokens, [])

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        out = []
        for rid, (prompt, n, tokens) in list(self.requests.items()):
            tokens.append((sum(prompt) + len(tokens)) % 97)
            out.append(_Output(rid, list(tokens)))
            if len(tokens) == n:
                del self.requests[rid]
        return out


class LLM:
    def __init__(self, model, **kwargs):
        if os.path.basename(model) == "unsupported":
            raise RuntimeError("Unsupported CPU attention configuration: head_dim=8")
        self.llm_engine = _Engine()
'''
STUB_TORCH = '__version__ = "stub"\n\ndef get_num_threads():\n    return 1\n'


def stub_tokens(prompt: list[int], n: int) -> list[int]:
    return [(sum(prompt) + k) % 97 for k in range(n)]


@pytest.fixture
def stub_venv(tmp_path, monkeypatch) -> Path:
    """A venv where the peer's venv goes, holding the stub vllm and torch, marked as set up."""
    monkeypatch.setenv("PIPESERVE_CACHE", str(tmp_path / "cache"))
    venv = vllm_peer.venv_dir()
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text(STUB_VLLM)
    (site / "torch.py").write_text(STUB_TORCH)
    (venv / "pipeserve-peer.json").write_text(json.dumps({"vllm": "stub", "torch": "stub"}))
    return venv


def test_the_peer_needs_its_venv(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PIPESERVE_CACHE", str(tmp_path))
    reason = vllm_peer.missing_reason()
    assert reason is not None and vllm_peer.SETUP_HINT in reason
    with pytest.raises(vllm_peer.PeerError, match="peers setup vllm"):
        vllm_peer.VllmPeer(str(tmp_path), "float32", [0], 1, 64)


def test_worker_runs_batches_on_the_given_cores(stub_venv, tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    core = sorted(os.sched_getaffinity(0))[-1]
    with vllm_peer.VllmPeer(str(model), "float32", [core], 4, 64) as peer:
        assert peer.info["vllm"] == "stub" and peer.info["threads_bind"] == str(core)
        prompts = [[1, 2, 3], [4, 5], [6]]
        run = peer.generate(prompts, [3, 5, 1])
        assert run.outputs == [stub_tokens(p, n) for p, n in zip(prompts, [3, 5, 1], strict=True)]
        assert run.steps == 5  # the longest request's tokens, one per step
        assert 0 < run.first_token_s <= run.seconds
        again = peer.generate([[7, 7]], [2])  # the worker serves batch after batch
        assert again.outputs == [stub_tokens([7, 7], 2)]
    assert peer.process.returncode == 0  # EOF on its stdin ended it
    assert not peer.log.exists()  # kept only when vLLM failed


def test_a_worker_that_cannot_start_says_why(stub_venv, tmp_path) -> None:
    model = tmp_path / "unsupported"
    model.mkdir()
    with pytest.raises(vllm_peer.PeerError, match="head_dim=8") as failed:
        vllm_peer.VllmPeer(str(model), "float32", [0], 1, 64)
    log = Path(str(failed.value).split("(log ")[1].split(")")[0])
    assert "head_dim=8" in log.read_text()  # the worker's traceback, kept for the reader
    log.unlink()


def test_bench_cores_pins_for_the_block_and_restores() -> None:
    before = os.sched_getaffinity(0)
    with vllm_peer.bench_cores(1) as cores:
        assert cores == [max(before)] and os.sched_getaffinity(0) == {max(before)}
    assert os.sched_getaffinity(0) == before


def test_presets_and_the_76m_shape() -> None:
    c = LLAMA_76M_V512
    head_dim = c["head_dim"]
    attention = c["hidden_size"] * head_dim * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    mlp = 3 * c["hidden_size"] * c["intermediate_size"]
    params = c["num_hidden_layers"] * (attention + mlp) + c["vocab_size"] * c["hidden_size"]
    assert 75e6 < params < 77e6 and c["hidden_size"] == c["num_attention_heads"] * head_dim == 768
    p = presets.PRESETS
    assert (p["llama76m-offline"].batch, p["llama76m-offline"].prompt_len, p["llama76m-offline"].new_tokens) \
        == (64, 128, 128)
    assert p["llama76m-prefill"].new_tokens == 1 and p["llama76m-prefill"].figure == "prompt_tokens_per_s"
    assert p["llama76m-decode-bf16"].dtype == "bfloat16" and p["llama76m-decode-bf16"].target == 1.0
    assert p["llama76m-batch1"].target == 1.5 and p["stories-equal"].peer == "hf generate"
    assert all(set(preset.systems) <= set(step.SYSTEMS) for preset in p.values())


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    step.add_arguments(parser)
    return parser.parse_args(argv)


def test_a_preset_fills_what_the_flags_leave() -> None:
    preset, args = step.resolve(parse(["--preset", "llama76m-decode", "--new-tokens", "8"]))
    assert preset is presets.PRESETS["llama76m-decode"]
    assert (args.batch, args.prompt_len, args.new_tokens, args.dtype) == ([64], 16, 8, "float32")
    assert args.systems == "pipeserve compiled,vllm-cpu"
    _, plain = step.resolve(parse([]))
    assert (plain.batch, plain.new_tokens, plain.repeats) == ([1, 8, 32], 128, 3)
    assert "vllm-cpu" not in plain.systems  # asked for by name or by a preset only


def test_figures_end_to_end_and_per_phase_by_hand() -> None:
    runs = [step.Timed([[0]], seconds=2.0, first_token_s=0.5), step.Timed([[0]], 4.0, 1.0),
            step.Timed([[0]], 3.0, 0.8)]
    row = step.summarize(batch=4, prompt_len=10, new_tokens=11, runs=runs)
    assert row["e2e_s"] == 3.0 and row["e2e_tokens_per_s"] == 4 * 11 / 3.0
    assert row["prefill_s"] == 0.8 and row["prompt_tokens_per_s"] == 4 * 10 / 0.8
    # decode: (e2e - first token) over the 10 steps after it, the median of the repeats
    assert row["decode_ms_per_step"] == pytest.approx(220.0)  # the runs': 150, 300, 220
    assert row["decode_tokens_per_s"] == pytest.approx(4 * 1e3 / 220.0)
    only_prefill = step.summarize(batch=2, prompt_len=8, new_tokens=1, runs=runs[:1])
    assert only_prefill["decode_ms_per_step"] is None


def test_targets_are_judged_on_the_presets_figure() -> None:
    preset = presets.PRESETS["llama76m-prefill"]
    row = {"pipeserve compiled": {"prompt_tokens_per_s": 600.0}, "vllm-cpu": {"prompt_tokens_per_s": 500.0}}
    verdict = step.judge(preset, row)
    assert verdict["ratio"] == pytest.approx(1.2) and verdict["met"] is True
    row["vllm-cpu"]["prompt_tokens_per_s"] = 700.0
    assert step.judge(preset, row)["met"] is False
    assert step.judge(preset, {"pipeserve compiled": {"prompt_tokens_per_s": 1.0}})["met"] is None


def test_bench_step_runs_the_peer_alternated_and_reports_ratios(stub_venv, tiny_model, tmp_path) -> None:
    args = parse(["--model", tiny_model("llama"), "--batch", "2", "--prompt-len", "4", "--new-tokens", "3",
                  "--repeats", "2", "--profile-steps", "0", "--systems", "pipeserve eager,vllm-cpu",
                  "--json", str(tmp_path / "s.json")])
    assert step.main(args) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert result["skipped"] == {} and result["reference"] == "pipeserve eager"
    assert result["cores"] == [max(os.sched_getaffinity(0))]
    row = result["batches"]["2"]
    peer = row["vllm-cpu"]
    assert len(peer["repeats_e2e_s"]) == 2 and peer["e2e_s"] >= peer["prefill_s"] > 0
    assert peer["same_tokens"] is False and peer["same_requests"] == 0.0  # the stub's are not the model's
    assert "pipeserve_speedup" not in row["pipeserve eager"]  # ratios are against the default engine only


@pytest.mark.slow  # ~6 s; test_bench_step_runs_the_peer_alternated_and_reports_ratios stays fast
def test_bench_step_skips_a_peer_that_cannot_start(stub_venv, tmp_path, tiny_model) -> None:
    unsupported = tmp_path / "unsupported"
    unsupported.mkdir()
    for name in os.listdir(tiny_model("llama")):
        os.symlink(os.path.join(tiny_model("llama"), name), unsupported / name)
    args = parse(["--model", str(unsupported), "--batch", "1", "--prompt-len", "4", "--new-tokens", "2",
                  "--repeats", "1", "--profile-steps", "0", "--systems", "pipeserve eager,vllm-cpu",
                  "--json", str(tmp_path / "s.json")])
    assert step.main(args) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert "head_dim=8" in result["skipped"]["vllm-cpu"]
    assert set(result["batches"]["1"]) == {"pipeserve eager"}


def test_bench_offline_runs_the_peer_on_the_same_requests(stub_venv, tiny_model, traces_dir,
                                                          tmp_path) -> None:
    parser = argparse.ArgumentParser()
    offline.add_arguments(parser)
    args = parser.parse_args(["--model", tiny_model("llama"), "--num-requests", "3", "--batch-size", "2",
                              "--repeats", "1", "--no-hf", "--vllm", "--threads", "1",
                              "--overhead-requests", "4", "--overhead-context", "16",
                              "--json", str(tmp_path / "o.json")])
    assert offline.main(args) == 0
    (entry,) = json.loads((tmp_path / "o.json").read_text())["models"]
    assert entry["vllm_skipped"] is None and len(entry["vllm_runs_s"]) == 1
    assert entry["speedup_vs_vllm"] == pytest.approx(entry["vllm_s"] / entry["pipeserve_s"])
    assert entry["vllm_same_requests"] == 0.0  # the stub's tokens are not the model's


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_vllm_cpu_matches_pipeserve_greedy(tiny_model) -> None:
    """vLLM-CPU itself, when `pipeserve bench peers setup vllm` has been run here: the same greedy
    ids as pipeserve on a tiny fp32 Llama (head_dim 64: vLLM's CPU attention refuses 8)."""
    # The tests' cache dir is a temporary one: the venv is where the setup puts it by default.
    venv = Path.home() / ".cache" / "pipeserve" / "peers" / f"vllm-cpu-{vllm_peer.VLLM_CPU_VERSION}"
    if reason := vllm_peer.missing_reason(venv):
        pytest.skip(reason)
    from pipeserve.bench.harness import run_batch
    from pipeserve.engine import LLM

    model = tiny_model("llama")
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    ours = run_batch(LLM(model, device="cpu", dtype="float32").engine, prompts, 6).outputs
    with vllm_peer.bench_cores(1) as cores:
        with vllm_peer.VllmPeer(model, "float32", cores, 2, 64, venv=venv) as peer:
            assert peer.generate(prompts, [6, 6]).outputs == ours


def test_peers_command_checks_the_venv(stub_venv) -> None:
    from pipeserve.cli import main

    assert main(["bench", "peers", "check", "vllm"]) == 0
    assert main(["bench", "peers", "check", "vllm", "--venv", str(stub_venv.parent / "none")]) == 1


def test_worker_script_imports_nothing_of_pipeserve() -> None:
    source = Path(step.__file__).with_name("vllm_worker.py").read_text()
    assert "pipeserve" not in "\n".join(line for line in source.splitlines()
                                        if line.startswith(("import", "from")))
    assert textwrap.dedent(source).count('if __name__ == "__main__":') == 1
