"""The roofline cost model against figures worked out by hand from the published shapes and datasheets."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipeserve import cli
from pipeserve.capacity.gpus import GIB, GPU, GPUS, TB
from pipeserve.capacity.roofline import (
    PRESETS,
    ModelShape,
    cost_model,
    decode_step_cost,
    prefill_cost,
    roofline,
    step_time,
)
from tests.conftest import STORIES, png_panels

pytestmark = pytest.mark.timeout(60)

H200 = GPU.get("H200")
H200_MEASURED = H200.with_overrides(bandwidth=4.3 * TB)
LLAMA2 = ModelShape.preset("llama-2-7b")
LLAMA3 = ModelShape.preset("llama-3-8b")

LLAMA2_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "tie_word_embeddings": False,
}


def test_llama2_7b_weights_and_batch1_floor() -> None:
    cost = cost_model(LLAMA2, H200)
    # 6.74e9 parameters: 13.5 GB in bf16; every weight but the 32000 x 4096 embedding read per token.
    assert LLAMA2.params == pytest.approx(6.738e9, rel=1e-3)
    assert cost.weight_bytes / 1e9 == pytest.approx(13.48, abs=0.01)
    assert cost.weight_bytes_read / 1e9 == pytest.approx(13.21, abs=0.01)
    assert cost.weight_bytes - cost.weight_bytes_read == 2 * 32000 * 4096
    step = decode_step_cost(LLAMA2, H200, batch=1, context=1)
    assert step.bound == "memory"
    assert step.t * 1e3 == pytest.approx(2.75, abs=0.01)
    assert decode_step_cost(LLAMA2, H200_MEASURED, 1, 1).t * 1e3 == pytest.approx(3.07, abs=0.01)


def test_llama3_8b_batch1_floor() -> None:
    assert cost_model(LLAMA3, H200).weight_bytes_read / 1e9 == pytest.approx(15.0, abs=0.02)
    assert decode_step_cost(LLAMA3, H200, 1, 1).t * 1e3 == pytest.approx(3.13, abs=0.01)
    assert decode_step_cost(LLAMA3, H200_MEASURED, 1, 1).t * 1e3 == pytest.approx(3.49, abs=0.01)


def test_kv_bytes_per_token() -> None:
    assert cost_model(LLAMA2, H200).kv_bytes_per_token == 512 * 1024
    assert cost_model(LLAMA3, H200).kv_bytes_per_token == 128 * 1024
    # int8 with an fp16 scale per 8 channels: 1.25 bytes per element; fp8: 1 byte.
    assert cost_model(LLAMA2, H200, kvdtype="int8").kv_bytes_per_token == 320 * 1024
    assert cost_model(LLAMA2, H200, kvdtype="fp8").kv_bytes_per_token == 256 * 1024
    # At 4k context the 7B reads 2.15 GB of KV per step on top of its weights.
    extra = decode_step_cost(LLAMA2, H200, 1, 4096).bytes - decode_step_cost(LLAMA2, H200, 1, 1).bytes
    assert extra / 1e9 == pytest.approx(2.147, abs=0.001)


def test_quantized_weights() -> None:
    bf16 = cost_model(LLAMA2, H200).weight_bytes_read
    int8 = cost_model(LLAMA2, H200, "int8")
    # Norm weights stay bf16, so "halve" is exact up to 0.01%.
    assert int8.weight_bytes_read == pytest.approx(bf16 / 2, rel=1e-4)
    assert cost_model(LLAMA2, H200, "fp8").weight_bytes_read == int8.weight_bytes_read
    assert decode_step_cost(LLAMA2, H200_MEASURED, 1, 1, "int8").t * 1e3 == pytest.approx(1.54, abs=0.01)
    int4 = cost_model(LLAMA2, H200, "int4").weight_bytes_read
    assert int4 == pytest.approx(bf16 / 2 * (0.5 + 2 / 128), rel=1e-3)
    assert decode_step_cost(LLAMA2, H200_MEASURED, 1, 1, "int4").t * 1e3 == pytest.approx(0.79, abs=0.01)
    # A bf16 lm_head adds one byte per lm_head weight to int8.
    bf16_head = cost_model(LLAMA2, H200, "int8", quantize_lm_head=False).weight_bytes_read
    assert bf16_head - int8.weight_bytes_read == 32000 * 4096
    # W8A8 GEMMs run on int8 tensor cores (2x bf16 on Hopper): prefill time halves too.
    p16, p8 = prefill_cost(LLAMA2, H200, 2048), prefill_cost(LLAMA2, H200, 2048, wdtype="int8")
    assert p8.t < 0.55 * p16.t


def test_prefill_is_compute_bound_with_hand_worked_flops() -> None:
    n = 2048
    cost = prefill_cost(LLAMA2, H200, n)
    assert cost.bound == "compute"
    linear = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    attention = 4 * 32 * 32 * 128 * n * (n + 1) // 2  # causal: query i sees i + 1 keys
    assert cost.flops == 2 * linear * n + 2 * 32000 * 4096 + attention
    assert cost.t == pytest.approx(cost.flops / 989e12)
    assert cost.t * 1e3 == pytest.approx(27.93, abs=0.01)  # 2.763e13 FLOP at 989 TFLOP/s
    assert prefill_cost(LLAMA2, H200, 8).bound == "memory"  # 8 tokens: still the weight read


def test_decode_turns_compute_bound_at_large_batch() -> None:
    # Ridge point: 989 TFLOP/s / 4.8 TB/s = 206 FLOP/byte; a bf16 weight gives 1 FLOP/byte per token.
    assert decode_step_cost(LLAMA2, H200, 128, 1).bound == "memory"
    assert decode_step_cost(LLAMA2, H200, 512, 1).bound == "compute"
    # More context per request adds KV bytes and attention FLOPs, never less time.
    ts = [decode_step_cost(LLAMA3, H200, 64, c).t for c in (128, 1024, 8192)]
    assert ts == sorted(ts)


def test_merge_step_composes_decode_and_prefill() -> None:
    cost = cost_model(LLAMA3, H200)
    decode = cost.decode(16, 1000)
    prefill = cost.prefill(256, cached=512)
    merged = cost.step(decode_contexts=[1000] * 16, prefill_chunks=[(256, 512)])
    assert cost.step(decode_contexts=[1000] * 16) == decode
    assert cost.step(prefill_chunks=[(256, 512)]) == prefill
    # Weights are read once per step, everything else adds up.
    assert merged.bytes == pytest.approx(decode.bytes + prefill.bytes - cost.weight_bytes_read)
    assert merged.flops == pytest.approx(decode.flops + prefill.flops)
    assert merged.t == max(merged.t_mem, merged.t_compute)
    assert step_time(LLAMA3, H200, [1000] * 16, [(256, 512)]) == merged.t
    assert cost.step().t == 0.0
    assert cost.prefill(4, batch=3) == cost.step(prefill_chunks=[(4, 0)] * 3)


def test_a_step_is_priced_in_closed_form_for_the_simulator() -> None:
    """The simulator prices every step it replays: a chunk's cost is a formula in its length, never a
    loop over its tokens, so a chunk of 10^12 tokens is priced as exactly as a small one."""
    n = cached = 10**12
    full = cost_model(LLAMA3, H200)
    assert full._pairs(cached, n) == cached * n + n * (n + 1) // 2
    windowed = cost_model(ModelShape.preset("mistral-7b"), H200)
    assert windowed._pairs(cached, n) == 4096 * n  # every query past the window sees 4096 keys
    assert windowed._pairs(4000, 200) == sum(min(p, 4096) for p in range(4001, 4201))
    huge = full.step([10**12] * 4, [(n, cached)])
    assert huge.t == max(huge.t_mem, huge.t_compute) > full.step([1000] * 4, [(512, 0)]).t


def test_sliding_window_matches_brute_force() -> None:
    w = 5
    shape = ModelShape("tiny-window", 64, 128, 2, 4, 2, 16, 100, sliding_window=w)
    cost = cost_model(shape, H200)
    per_pair = 4 * 2 * 4 * 16
    per_token = 2 * 2 * 16 * 2 * 2  # K and V, layers, kv heads, head_dim, bf16
    for cached in range(0, 12):
        for n in range(1, 12):
            pairs = sum(min(p + 1, w) for p in range(cached, cached + n))
            span = min(cached + n, w + n - 1)  # keys from max(0, cached - w + 1) to cached + n - 1
            c = cost.prefill(n, cached)
            assert c.flops == 2 * shape.linear_params * n + 2 * 100 * 64 + per_pair * pairs
            assert c.bytes == cost.weight_bytes_read + (span + n) * per_token
    # Mistral-7B decode reads at most its 4096-token window.
    mistral = ModelShape.preset("mistral-7b")
    assert decode_step_cost(mistral, H200, 8, 8192) == decode_step_cost(mistral, H200, 8, 4096)


def test_memory_capacity() -> None:
    cost = cost_model(LLAMA2, H200)
    free = 141 * GIB * 0.9 - cost.weight_bytes
    assert cost.kv_capacity_tokens(0.9) == int(free // (512 * 1024))
    assert cost.kv_capacity_tokens(0.9) == pytest.approx(234_186, abs=1)
    # 70B in bf16 (138 GB) does not fit a 24 GiB card: no KV at all.
    assert cost_model(ModelShape.preset("llama-2-70b"), GPU.get("RTX4090")).kv_capacity_tokens() == 0
    result = roofline(LLAMA2, H200, batches=[1, 300], contexts=[1024])
    fits = {p["batch"]: (p["requests_fit"], p["fits"]) for p in result["points"]}
    assert fits == {1: (228, True), 300: (228, False)}


def test_hf_config_and_presets() -> None:
    assert ModelShape.from_hf_config(LLAMA2_HF_CONFIG, name="llama-2-7b") == LLAMA2
    qwen = {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    }
    assert ModelShape.from_hf_config(qwen, name="qwen2-7b") == PRESETS["qwen2-7b"]
    assert PRESETS["qwen2-7b"].params == pytest.approx(7.616e9, rel=1e-3)
    assert PRESETS["llama-2-70b"].params == pytest.approx(68.98e9, rel=1e-3)
    assert ModelShape.preset("Llama-3-8B") == LLAMA3
    with pytest.raises(ValueError, match="DeepSeek"):
        ModelShape.from_hf_config({**LLAMA2_HF_CONFIG, "n_routed_experts": 64})
    with pytest.raises(ValueError, match="preset"):
        ModelShape.resolve("no-such-model")


@pytest.mark.skipif(not STORIES.exists(), reason=f"stories260K not found at {STORIES} (set PIPESERVE_SHARED)")
def test_checkpoint_dir_counts_match_safetensors() -> None:
    from safetensors import safe_open

    shape = ModelShape.resolve(str(STORIES))
    with safe_open(str(STORIES / "model.safetensors"), "np") as f:
        numel = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert shape.tie_word_embeddings and shape.num_kv_heads == 4 and shape.head_dim == 8
    assert shape.params == numel
    assert ModelShape.from_path(STORIES / "config.json") == shape and shape.name == "stories260K"
    cost = cost_model(shape, H200)
    # Tied: the embedding table is lm_head, held once and read once per step.
    assert cost.weight_bytes == cost.weight_bytes_read == 2 * numel


def test_gpu_table_and_overrides() -> None:
    assert set(GPUS) >= {
        "A100-40G",
        "A100-80G",
        "H100-SXM",
        "H100-PCIe",
        "H200",
        "H20",
        "L40S",
        "RTX4090",
        "A10",
    }
    assert GPU.get("rtx 4090") is GPUS["RTX4090"] and GPU.get("h100_sxm") is GPUS["H100-SXM"]
    with pytest.raises(ValueError, match="known"):
        GPU.get("TPU")
    a100 = GPU.get("A100-80G")
    assert a100.gemm_rate("fp8") == a100.bf16_flops  # no fp8 tensor cores: weights dequantized to bf16
    measured = GPUS["H100-SXM"].with_overrides(bandwidth=3.0 * TB, flops=700 * TB)
    assert measured.bandwidth == 3.0 * TB and measured.bf16_flops == 700 * TB
    assert measured.fp8_flops == pytest.approx(1979 * 700 / 989 * TB)
    assert GPUS["H200"].with_overrides() is GPUS["H200"]


def test_cli_writes_table_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plots"
    rc = cli.main([
        "roofline", "--model", "llama-3-8b", "--gpu", "H100-SXM", "--wdtype", "bf16", "int8",
        "--kv-dtype", "bf16", "int8", "--batch", "1", "8", "64", "--context", "512", "4096",
        "--json", str(tmp_path / "r.json"), "--out", str(out),
    ])  # fmt: skip
    assert rc == 0
    assert "llama-3-8b on H100-SXM" in capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["model"]["name"] == "llama-3-8b" and result["gpu"]["name"] == "H100-SXM"
    assert len(result["dtypes"]) == 4 and len(result["points"]) == 2 * 2 * 3 * 2
    point = result["points"][0]
    assert set(point) == {
        "wdtype", "kvdtype", "batch", "context", "decode", "prefill", "ms_per_token", "tokens_per_s",
        "prefill_tokens_per_s", "requests_fit", "fits",
    }  # fmt: skip
    assert set(point["decode"]) == {"bytes", "flops", "t_mem_ms", "t_compute_ms", "t_ms", "bound"}
    assert point["ms_per_token"] == pytest.approx(decode_step_cost(LLAMA3, GPUS["H100-SXM"], 1, 512).t * 1e3)
    assert (out / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="neither a preset"):
        cli.main(["roofline", "--model", "/nonexistent/model"])


def test_report_helpers(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    from pipeserve.bench.report import (
        Panel,
        Series,
        cdf_series,
        figure,
        fmt,
        machine_info,
        plot_panels,
        write_json,
    )

    step = decode_step_cost(LLAMA2, H200, 1, 1)
    values = {"x": np.float32(0.5), "inf": math.inf, "arr": np.arange(3), "step": step, "p": tmp_path}
    path = write_json(tmp_path / "a" / "b.json", values)
    data = json.loads(path.read_text())
    assert (
        data["x"] == 0.5 and data["inf"] is None and data["arr"] == [0, 1, 2] and data["p"] == str(tmp_path)
    )
    assert set(data["step"]) == {"bytes", "flops", "t_mem", "t_compute", "t"}
    assert [fmt(v) for v in (None, True, 1234567, 93456.7, 2.75321, 0.000123, "int8")] == [
        "-", "yes", "1,234,567", "93,457", "2.753", "1.230e-04", "int8",
    ]  # fmt: skip
    cdf = cdf_series("ttft", [3.0, 1.0, 2.0, 4.0])
    assert list(cdf.x) == [1.0, 2.0, 3.0, 4.0] and list(cdf.y) == [0.25, 0.5, 0.75, 1.0]
    panels = [
        Panel("fraction", [cdf], xlabel="TTFT s"),
        Panel("ms", [Series("a", [1, 2, 4], [3, 2, 1]), Series("b", [1, 2], [5, 6])], logx=True, logy=True),
    ]
    fig = figure(panels, title="t")
    try:
        left, right = fig.axes
        assert (left.get_xlabel(), left.get_ylabel(), left.get_xscale()) == ("TTFT s", "fraction", "linear")
        ((x, y),) = [line.get_data() for line in left.get_lines()]
        assert list(x) == [1.0, 2.0, 3.0, 4.0] and list(y) == [0.25, 0.5, 0.75, 1.0]
        assert (right.get_xscale(), right.get_yscale()) == ("log", "log")
        assert [line.get_label() for line in right.get_lines()] == ["a", "b"]
        assert [t.get_text() for t in right.get_legend().get_texts()] == ["a", "b"]
        assert fig._suptitle.get_text() == "t"
    finally:
        plt.close(fig)
    assert png_panels(plot_panels(tmp_path / "two.png", panels)) == 2
    assert {"host", "cpu_count", "python", "git_commit"} <= set(machine_info())
