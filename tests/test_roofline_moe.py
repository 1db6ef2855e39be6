"""The roofline and the simulator on mixtures of experts: total and active parameters of the
Mixtral-8x7B / Qwen3-30B-A3B presets against their published counts, HF configs (and a tiny
checkpoint's tensors) read into the same shapes, the expected distinct experts a batch touches, and
what a step reads and computes because of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from pipeserve.capacity.gpus import GPU
from pipeserve.capacity.roofline import PRESETS, ModelShape, cost_model

MIXTRAL = PRESETS["mixtral-8x7b"]
QWEN3 = PRESETS["qwen3-30b-a3b"]


def test_presets_match_the_published_parameter_counts():
    # Mistral AI: 46.7 B parameters, 12.9 B used per token; Qwen: 30.5 B total, 3.3 B activated.
    assert MIXTRAL.params == pytest.approx(46.70e9, rel=2e-3)
    assert MIXTRAL.active_params == pytest.approx(12.88e9, rel=2e-3)
    assert QWEN3.params == pytest.approx(30.53e9, rel=2e-3)
    assert QWEN3.active_params == pytest.approx(3.35e9, rel=1e-2)
    dense = PRESETS["llama-2-7b"]
    assert dense.active_params == dense.params and dense.experts_touched(64) == 0.0


def test_hf_configs_read_as_the_presets():
    mixtral = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
        "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None,
    }
    assert replace(ModelShape.from_hf_config(mixtral), name=MIXTRAL.name) == MIXTRAL
    qwen3 = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "sliding_window": None, "use_sliding_window": False,
    }
    assert replace(ModelShape.from_hf_config(qwen3), name=QWEN3.name) == QWEN3


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_tiny_checkpoint_params_match_its_tensors(tiny_model, kind):
    from safetensors import safe_open

    path = tiny_model(kind)
    shape = ModelShape.from_path(path)
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        total = sum(_numel(f.get_slice(n).get_shape()) for n in f.keys())  # noqa: SIM118
    norms = 2 * shape.num_layers * shape.head_dim if kind == "qwen3_moe" else 0  # q/k norms: not modelled
    assert shape.params == total - norms
    assert shape.moe_layers == (2 if kind == "mixtral" else 1)


def _numel(dims: list[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def test_experts_touched():
    assert MIXTRAL.experts_touched(1) == pytest.approx(2.0)
    assert QWEN3.experts_touched(1) == pytest.approx(8.0)
    # 8 of 128 per token: 16 tokens touch 1 - (15/16)^16 of them, about 81.
    assert QWEN3.experts_touched(16) == pytest.approx(128 * (1 - (120 / 128) ** 16))
    counts = [QWEN3.experts_touched(b) for b in (1, 2, 8, 64, 512)]
    assert counts == sorted(counts) and counts[-1] == pytest.approx(128, rel=1e-6)


def test_decode_reads_only_the_touched_experts():
    gpu = GPU.get("H100-SXM")
    cost = cost_model(QWEN3, gpu)
    expert = 3 * 2048 * 768 * 2 * 48  # one expert of every layer, bf16
    assert cost.expert_bytes == expert
    one, many = cost.decode(1, 1024), cost.decode(256, 1024)
    kv = cost.kv_bytes_per_token
    assert one.bytes == pytest.approx(cost.weight_bytes_read + 8 * expert + 1025 * kv)
    touched = QWEN3.experts_touched(256)
    assert many.bytes == pytest.approx(cost.weight_bytes_read + touched * expert + 256 * 1025 * kv)
    # FLOPs follow the active parameters, memory the total: all experts are held.
    assert cost.gemm_flops_per_token == 2.0 * QWEN3.active_linear_params
    assert cost.weight_bytes > cost.weight_bytes_read + 128 * expert - 1
    # At batch 1 an MoE step reads far less than its dense equivalent of the same total size would.
    assert one.t < cost_model(replace(QWEN3, experts_per_tok=128), gpu).decode(1, 1024).t / 8


def test_roofline_cli_prints_moe_presets(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pipeserve.cli", "roofline", "--model", "mixtral-8x7b", "--gpu", "H100-SXM",
         "--batch", "1", "64", "--json", str(out)], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "12.88 B active" in proc.stdout and "experts" in proc.stdout
    result = json.loads(out.read_text())
    assert result["model"]["active_params"] == MIXTRAL.active_params
    assert [p["experts_touched"] for p in result["points"]] == pytest.approx([2.0, 8.0], rel=1e-6)


@pytest.mark.slow
def test_simulator_runs_an_moe_preset(traces_dir, tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pipeserve.cli", "simulate", "--model", "qwen3-30b-a3b", "--gpu", "H200",
         "--policy", "max", "--requests", "200", "--json", str(out)], capture_output=True, text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.exists()
