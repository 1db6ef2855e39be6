"""Load-time quantization: weight formats, quantized linear layers, fused norm/activation quantization,
the model surgery, the engine options, the per-token vs per-tensor outlier experiment and the bench."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pipeserve.engine.backend import get_backend, reference
from pipeserve.engine.kv.pool import kv_bytes_per_page, kv_bytes_per_token
from pipeserve.engine.model.accuracy import logits_error, teacher_forced_logits
from pipeserve.engine.model.llama import RMSNorm
from pipeserve.engine.model.loader import load_model
from pipeserve.engine.quantization.fused import QuantRMSNorm, SiluMulQuant
from pipeserve.engine.quantization.linear import QuantAct, W4A16Linear, W8A8Linear
from pipeserve.engine.quantization.model import quantize_model, weight_bytes
from pipeserve.engine.quantization.weights import group_size, padded_in_features, quantize_4bit

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("torch_one_thread")]
TORCH = get_backend("cpu")
rms_norm, per_token_quant_ref = TORCH.rms_norm, reference.per_token_quant
scaled_mm_ref = reference.scaled_gemm
FP8 = torch.float8_e4m3fn


def linear(k: int, n: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.1)
    return layer


@pytest.mark.parametrize("k,group,padded", [(64, 64, 64), (172, 128, 256), (256, 128, 256), (100, 100, 200)])
def test_group_is_min_of_128_and_k_and_ragged_k_is_padded(k, group, padded):
    assert group_size(k) == group
    assert padded_in_features(k) == padded
    assert padded % group == 0 and padded % 8 == 0


@pytest.mark.parametrize("fmt", ["int4", "nf4"])
@pytest.mark.parametrize("k", [64, 172])
def test_4bit_weights_round_trip_within_half_a_step(fmt, k):
    w = torch.randn(48, k) * 0.1
    packed = quantize_4bit(w, fmt, clip_ratios=(1.0,))  # plain round-to-nearest
    deq = packed.dequantize()
    assert deq.shape == w.shape
    g = group_size(k)
    assert packed.scales.shape == (packed.padded_k // g, 48)
    scales = packed.scales.float().T.repeat_interleave(g, dim=1)[:, :k]  # [N, K]
    if fmt == "int4":  # asymmetric: every weight within half a step of its group's grid
        assert ((deq - w).abs() <= scales / 2 + 1e-6).all()
    else:  # NF4 levels are at most 0.17 apart (around +-0.6..1): error below 0.17 x absmax
        assert ((deq - w).abs() <= 0.17 * scales + 1e-6).all()


def test_int4_clip_search_never_loses_to_round_to_nearest_per_group():
    w = torch.randn(64, 256) * 0.1
    err = {}
    for name, ratios in (("rtn", (1.0,)), ("search", None)):
        deq = quantize_4bit(w, "int4", clip_ratios=ratios).dequantize()
        err[name] = (deq - w).square().view(64, 2, 128).sum(-1)
    assert (err["search"] <= err["rtn"] + 1e-9).all()
    assert err["search"].sum() < 0.95 * err["rtn"].sum()  # Gaussian weights: the tails cost levels


@pytest.mark.parametrize("fmt", ["int4", "nf4"])
def test_w4a16_linear_matches_its_dequantized_weight_on_ragged_k(fmt):
    layer = linear(172, 40, bias=True)
    q = W4A16Linear(layer, fmt, TORCH)
    x = torch.randn(5, 172)
    expected = x @ q.packed().dequantize().T + layer.bias
    torch.testing.assert_close(q(x), expected, rtol=1e-5, atol=1e-5)
    # ... and that weight is close to the float one: 4 bits, groups of 128
    assert (q(x) - layer(x)).norm() / layer(x).norm() < 0.15


@pytest.mark.parametrize("dtype", [torch.int8, FP8])
def test_w8a8_linear_runs_real_int8_fp8_gemms(dtype):
    layer = linear(96, 40, bias=True)
    q = W8A8Linear(layer, dtype, TORCH)
    x = torch.randn(7, 96)
    xq, xs = per_token_quant_ref(x, dtype)
    expected = scaled_mm_ref(xq, xs, q.weight, q.weight_scale, layer.bias, torch.float32)
    torch.testing.assert_close(q(x), expected, rtol=1e-5, atol=1e-4)
    assert q(QuantAct(xq, xs)).equal(q(x))  # a pre-quantized input takes the same path
    err = ((q(x) - layer(x)).norm() / layer(x).norm()).item()
    assert err < (0.02 if dtype == torch.int8 else 0.06)


def test_fused_norm_and_activation_quantize_what_the_unfused_path_would():
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5, TORCH)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, residual = torch.randn(6, 64), torch.randn(6, 64)
    fused = QuantRMSNorm(norm.weight, norm.eps, torch.int8, TORCH)
    act, new_residual = fused(x, residual)
    out, expected_residual = rms_norm(x, norm.weight, 1e-5, residual)
    q, s = per_token_quant_ref(out, torch.int8)
    assert act.q.equal(q) and act.scale.equal(s) and new_residual.equal(expected_residual)
    assert fused(x).q.equal(per_token_quant_ref(rms_norm(x, norm.weight, 1e-5), torch.int8)[0])
    gate_up = torch.randn(6, 2 * 86)
    act = SiluMulQuant(FP8, TORCH)(gate_up)
    silu = torch.nn.functional.silu(gate_up[:, :86]) * gate_up[:, 86:]
    assert act.q.float().equal(per_token_quant_ref(silu, FP8)[0].float())


@pytest.fixture(scope="module")
def stories_model(stories_dir):
    return lambda: load_model(stories_dir, TORCH, torch.device("cpu"), torch.float32, 512)[0]


@pytest.mark.parametrize("method", ["w8a8-int8", "w8a8-fp8", "w4a16", "nf4"])
def test_quantize_model_replaces_projections_and_keeps_the_rest(stories_model, method):
    model = stories_model()
    before = weight_bytes(model)
    embed, o_proj = model.embed_tokens.weight.clone(), model.layers[0].self_attn.o_proj
    quantize_model(model, method, "cpu")
    kind = W4A16Linear if method in ("w4a16", "nf4") else W8A8Linear
    for layer in model.layers:
        assert isinstance(layer.self_attn.qkv_proj, kind)
        assert isinstance(layer.mlp.gate_up_proj, kind) and isinstance(layer.mlp.down_proj, kind)
        assert type(layer.self_attn.o_proj) is nn.Linear  # PPL.LLM keeps O in float
        fused = kind is W8A8Linear
        assert isinstance(layer.input_layernorm, QuantRMSNorm) == fused
        assert isinstance(layer.mlp.act_fn, SiluMulQuant) == fused
    assert model.layers[0].self_attn.o_proj is o_proj and model.embed_tokens.weight.equal(embed)
    assert type(model.norm) is RMSNorm
    # stories260K: 0.26 M fp32 params, 0.19 M of them in q/k/v/gate/up/down
    linear_params = 5 * (64 * 128 + 64 * 344 + 172 * 64)
    saved = before - weight_bytes(model)
    per_param = {"w8a8-int8": 3, "w8a8-fp8": 3, "w4a16": 3.4, "nf4": 3.4}[method]
    assert saved > 0.9 * per_param * linear_params


def test_quantize_model_rejects_unknown_methods_and_bad_ablations(stories_model):
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(stories_model(), "int3", "cpu")
    with pytest.raises(ValueError, match="per-tensor"):
        quantize_model(stories_model(), "w4a16", "cpu", per_tensor=True)
    assert quantize_model(stories_model(), "none", "cpu") is not None


def test_engine_applies_quantization_and_kv_dtype_and_fits_more_tokens(stories_dir):
    from pipeserve.engine import LLM, SamplingParams

    budget = 0.002  # GiB
    tokens = {}
    for kv in ("auto", "int8", "fp8"):
        # Prefix caching off: with it, int8/fp8 pools also keep a mean-key row per page (kv_bytes_per_page).
        llm = LLM(stories_dir, device="cpu", quantization="w8a8-int8", kv_cache_dtype=kv, kv_cache_gb=budget,
                  prefix_caching=False, step_executor="eager")
        info = llm.engine.model_info()
        assert info["quantization"] == "w8a8-int8" and info["kv_cache_dtype"] == kv
        assert isinstance(llm.engine.model.layers[0].mlp.down_proj, W8A8Linear)
        tokens[kv] = info["num_pages"] * info["page_size"]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate(["Once upon a time"], greedy)[0]
    assert len(out.token_ids) == 8
    cfg = llm.engine.model_config
    # fp32 K/V: 4 bytes per element; int8/fp8: 1 byte + one fp16 scale per 8 channels (head_dim 8)
    assert kv_bytes_per_token(cfg, torch.float32) == 1280
    assert kv_bytes_per_token(cfg, torch.float32, "int8") == 400
    # With prefix caching a key-smoothed page also holds its sequence's mean key: 160 fp32 per page.
    assert kv_bytes_per_page(cfg, torch.float32, 16, "int8", prefix_caching=True) == 400 * 16 + 640
    assert kv_bytes_per_page(cfg, torch.float32, 16, "auto", prefix_caching=True) == 1280 * 16
    assert tokens["int8"] == tokens["fp8"]
    assert 3.0 < tokens["int8"] / tokens["auto"] < 3.3


def _with_outliers(model, factor: float, channels: torch.Tensor):
    """Channels x factor at the inputs of qkv_proj and gate_up_proj (norm weights), the weights'
    matching columns / factor: the float model computes the same function, its activations have outliers."""
    with torch.no_grad():
        for layer in model.layers:
            for norm, proj in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                               (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                norm.weight[channels] *= factor
                proj.weight[:, channels] /= factor
    return model


def test_per_token_and_per_channel_scales_beat_per_tensor_under_activation_outliers(tiny_model):
    path = tiny_model("llama")  # head_dim 64, hidden 128, 2 layers
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 320, (48,), generator=gen).tolist() for _ in range(4)]
    channels = torch.tensor([5, 40, 77, 100])

    def model(method: str = "none", per_tensor: bool = False):
        m = load_model(path, TORCH, torch.device("cpu"), torch.float32, 256)[0]
        return quantize_model(_with_outliers(m, 100.0, channels), method, "cpu", per_tensor=per_tensor)

    float_model = load_model(path, TORCH, torch.device("cpu"), torch.float32, 256)[0]
    ref = teacher_forced_logits(float_model, seqs)
    assert logits_error(teacher_forced_logits(model(), seqs), ref) < 1e-5  # same function in float
    err = {pt: logits_error(teacher_forced_logits(model("w8a8-int8", pt), seqs), ref) for pt in (False, True)}
    fp8 = logits_error(teacher_forced_logits(model("w8a8-fp8"), seqs), ref)
    print(f"\noutliers x100: w8a8-int8 logits error per-token/per-channel {err[False]:.3f}, "
          f"per-tensor {err[True]:.3f}; w8a8-fp8 per-token {fp8:.3f}")
    assert err[True] > 1.3 * err[False]
    # fp8's exponent absorbs the outliers that int8's uniform grid cannot
    assert fp8 < 0.25 * err[False]


@pytest.mark.slow  # a benchmark run on stories260K: ~2 s
def test_bench_quant_writes_json_and_markdown(stories_dir, tmp_path):
    from pipeserve.cli import main

    rc = main(["bench", "quant", "--model", stories_dir, "--setups", "none", "kv-int8", "w4a16",
               "--stories", "3", "--window", "64", "--greedy-tokens", "4", "--decode-batch", "2",
               "--decode-tokens", "3", "--gpu", "off", "--step-executor", "eager", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "quant.json").read_text())
    rows = {r["setup"]: r for r in result["cpu"]["rows"]}
    assert list(rows) == ["none", "kv-int8", "w4a16"]
    assert rows["none"]["ppl_delta_pct"] == 0 and rows["none"]["greedy_agreement"] == 1
    assert rows["kv-int8"]["kv_tokens_in_budget"] > 3 * rows["none"]["kv_tokens_in_budget"]
    assert rows["w4a16"]["weight_mib"] < rows["none"]["weight_mib"]
    assert all(r["decode_tokens_per_s"] > 0 for r in rows.values())
    assert "| w4a16 |" in (tmp_path / "quant.md").read_text()


def test_bench_quant_gpu_section_dry_run_on_the_cpu(stories_dir):
    """The GPU table's code path (engine step times, roofline floors, ratios to bf16) on a CPU."""
    import argparse

    from pipeserve.bench import quant

    parser = argparse.ArgumentParser()
    quant.add_arguments(parser)
    args = parser.parse_args(["--gpu-model", stories_dir, "--gpu-setups", "none", "w8a8-int8",
                              "--gpu-batch", "1", "2", "--gpu-input-len", "8", "--gpu-output-len", "3",
                              "--step-executor", "eager"])
    result = quant.gpu_section(args, device="cpu", backend="torch")
    rows = result["rows"]
    assert [(r["setup"], r["batch"]) for r in rows] == [("none", 1), ("none", 2), ("w8a8-int8", 1),
                                                        ("w8a8-int8", 2)]
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 and 0 < r["roofline_pct"] for r in rows)
    assert rows[0]["vs_bf16"] == 1.0
    # int8 weights: half the bytes, and no slower a floor (a CPU without AMX may be compute-bound).
    assert rows[2]["floor_mb"] < rows[0]["floor_mb"] and rows[2]["floor_ms"] <= rows[0]["floor_ms"]
