"""The model loader: safetensors streamed tensor by tensor, weights allocated unit by unit in the
serving dtype, quantization applied layer by layer while loading, and `load_format="dummy"`."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeserve.engine.backend import get_backend
from pipeserve.engine.model import loader
from pipeserve.engine.model.loader import load_model, read_safetensors
from pipeserve.engine.quantization.model import quantize_model
from pipeserve.preflight import StartupError, checkpoint

CPU = torch.device("cpu")
BACKEND = get_backend("cpu")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def test_read_safetensors_matches_the_library(tmp_path) -> None:
    tensors = {
        "b": torch.randn(3, 5).to(torch.bfloat16),
        "a": torch.randn(7),
        "c": torch.randint(-100, 100, (4, 2), dtype=torch.int8),
        "d": torch.randn(2, 2).to(torch.float16),
    }
    path = str(tmp_path / "x.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    with open(path, "rb") as f:
        read = {name: stored.read() for name, stored in read_safetensors(f)}
    expected = load_file(path)
    assert read.keys() == expected.keys()
    for name, tensor in expected.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor)


def test_truncated_file_is_refused(tmp_path) -> None:
    path = tmp_path / "x.safetensors"
    save_file({"w": torch.randn(64)}, str(path))
    path.write_bytes(path.read_bytes()[:-8])
    with open(path, "rb") as f, pytest.raises(ValueError, match="truncated"):
        [stored.read() for _, stored in read_safetensors(f)]


def test_large_tensors_are_read_in_row_blocks(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor larger than the read buffer arrives in blocks of rows, each cast on its way in."""
    monkeypatch.setattr(loader, "READ_CHUNK_BYTES", 4 * 64 * 3 + 8)  # 3 rows of 64 fp32 and a bit
    weight = torch.randn(10, 64)
    path = tmp_path / "x.safetensors"
    save_file({"w": weight}, str(path))
    with open(path, "rb") as f:
        (_, stored), = read_safetensors(f)
        buffer = torch.empty(loader.READ_CHUNK_BYTES, dtype=torch.uint8)
        blocks = [stored.read(start, min(10, start + 3), buffer).clone() for start in range(0, 10, 3)]
    assert [b.shape[0] for b in blocks] == [3, 3, 3, 1]
    assert torch.equal(torch.cat(blocks), weight)


@pytest.mark.parametrize("chunk", [16 * 2**20, 1000])
def test_fp32_checkpoint_loads_as_bf16_exactly(stories_dir: str, chunk: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "READ_CHUNK_BYTES", chunk)  # 1000: every matrix in blocks of rows
    model, cfg = load_model(stories_dir, BACKEND, CPU, torch.bfloat16, 256)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    assert not any(p.is_meta for p in params.values())
    weights = load_file(os.path.join(stories_dir, "model.safetensors"))
    assert torch.equal(params["embed_tokens.weight"], weights["model.embed_tokens.weight"].to(torch.bfloat16))
    q = weights["model.layers.2.self_attn.q_proj.weight"].to(torch.bfloat16)
    v = weights["model.layers.2.self_attn.v_proj.weight"].to(torch.bfloat16)
    qkv = params["layers.2.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[: q.shape[0]], q) and torch.equal(qkv[-v.shape[0]:], v)


@pytest.mark.parametrize("method", ["w8a8-int8", "w4a16"])
def test_quantized_while_loading_equals_quantizing_after(stories_dir: str, method: str) -> None:
    streamed, _ = load_model(stories_dir, BACKEND, CPU, torch.float32, 256, quantization=method)
    after = quantize_model(load_model(stories_dir, BACKEND, CPU, torch.float32, 256)[0], method, BACKEND)
    a, b = streamed.state_dict(), after.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert [type(m) for m in streamed.modules()] == [type(m) for m in after.modules()]


def test_a_missing_tensor_is_named(stories_dir: str, tmp_path) -> None:
    weights = load_file(os.path.join(stories_dir, "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(os.path.join(stories_dir, name), tmp_path)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj\.weight"):
        load_model(str(tmp_path), BACKEND, CPU, torch.float32, 256)


def test_units_are_allocated_one_at_a_time(stories_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a checkpoint streams in, a decoder layer is allocated only when its first tensor
    arrives: when layer 0's first tensor lands, every later layer is still on the meta device."""
    seen: list[tuple[str, int]] = []
    real = loader._Materializer._allocate

    def allocate(self: loader._Materializer, unit: str) -> None:
        real(self, unit)
        meta_layers = sum(any(p.is_meta for p in m.parameters()) for m in self.model.layers)
        seen.append((unit, meta_layers))

    monkeypatch.setattr(loader._Materializer, "_allocate", allocate)
    model, cfg = load_model(stories_dir, BACKEND, CPU, torch.bfloat16, 256)
    layers = dict(seen)
    assert layers["layers.0"] == cfg.num_layers - 1
    assert sorted(seen, key=lambda s: -s[1]) == seen  # each allocation leaves fewer layers unallocated


@pytest.fixture
def config_only_dir(stories_dir: str, tmp_path) -> str:
    """stories260K's config and tokenizer, no weights."""
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(os.path.join(stories_dir, name), tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("quantization", ["none", "w8a8-int8", "nf4"])
def test_dummy_weights_need_no_checkpoint(config_only_dir: str, quantization: str) -> None:
    model, cfg = load_model(config_only_dir, BACKEND, CPU, torch.bfloat16, 256, quantization=quantization,
                            load_format="dummy", seed=3)
    again, _ = load_model(config_only_dir, BACKEND, CPU, torch.bfloat16, 256, quantization=quantization,
                          load_format="dummy", seed=3)
    state, other = model.state_dict(), again.state_dict()
    assert all(torch.equal(state[k], other[k]) for k in state)  # the seed decides the weights
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    embed = params["embed_tokens.weight"].float()
    assert 0.015 < embed.std().item() < 0.025 and embed.abs().max() > 0  # never zeros
    assert torch.equal(params["norm.weight"], torch.ones_like(params["norm.weight"]))
    if quantization != "none":
        assert not any(isinstance(layer.self_attn.qkv_proj, torch.nn.Linear) for layer in model.layers)
    assert not os.path.exists(os.path.join(config_only_dir, "model.safetensors"))


def test_dummy_serves_through_llm(config_only_dir: str) -> None:
    from pipeserve import LLM, SamplingParams

    llm = LLM(config_only_dir, load_format="dummy", compile=False, num_pages=64)
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0))
    assert len(out[0].token_ids) == 8


def test_preflight_accepts_a_config_only_dir_for_dummy(config_only_dir: str) -> None:
    with pytest.raises(StartupError, match="--load-format dummy"):
        checkpoint("--model x", config_only_dir)
    assert checkpoint("--model x", config_only_dir, weights=False).num_layers > 0


def test_load_format_is_checked(stories_dir: str) -> None:
    with pytest.raises(ValueError, match="load_format"):
        load_model(stories_dir, BACKEND, CPU, torch.float32, 256, load_format="pt")


def test_loading_leaves_the_compiler_stack_unimported(tiny_model) -> None:
    """An eager engine's start does not pay for torch._dynamo or sympy (seconds of every start): the
    model is built on the meta device without random init and materialized by shape."""
    import subprocess
    import sys

    script = ("import sys\nfrom pipeserve.engine import LLM\n"
              f"LLM({tiny_model('llama')!r}, device='cpu', dtype='float32', backend='reference')\n"
              "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
