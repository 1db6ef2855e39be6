"""`pipeserve up` checks the ports, the model and the tokenizer before it starts any process, and a
problem ends it with one line that says what to do."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from pipeserve.config import EngineConfig, GatewayConfig
from pipeserve.local_cluster import ROOT, free_port
from pipeserve.preflight import StartupError, check_ports, resolve


def test_a_port_in_use_is_one_line() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        port = other.getsockname()[1]
        with pytest.raises(StartupError, match=f"port {port} on 127.0.0.1 is in use.*another --port"):
            check_ports(GatewayConfig(port=port))
        with pytest.raises(StartupError, match="choose another --metrics-port"):
            check_ports(GatewayConfig(port=free_port(), metrics_port=port))
        with pytest.raises(StartupError, match="choose another --http-port"):
            check_ports(GatewayConfig(port=free_port(), http_port=port))
    grpc = free_port()
    with pytest.raises(StartupError, match=f"--http-port {grpc} is also --port"):
        check_ports(GatewayConfig(port=grpc, http_port=grpc))
    with pytest.raises(StartupError, match="not an address of this machine"):
        check_ports(GatewayConfig(host="192.0.2.1", port=free_port()))
    check_ports(GatewayConfig(port=free_port(), metrics_port=free_port(), http_port=free_port()))


def test_model_problems(tmp_path: Path, stories_dir: str) -> None:
    with pytest.raises(StartupError, match="no such directory"):
        resolve(EngineConfig(model=str(tmp_path / "missing")))
    with pytest.raises(StartupError, match="has no config.json"):
        resolve(EngineConfig(model=str(tmp_path)))
    odd = tmp_path / "odd"
    shutil.copytree(stories_dir, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(StartupError, match="unsupported architecture.*LlamaForCausalLM"):
        resolve(EngineConfig(model=str(odd)))
    (odd / "config.json").write_text(json.dumps(config))
    (odd / "model.safetensors").unlink()
    with pytest.raises(StartupError, match="no \\*.safetensors weights"):
        resolve(EngineConfig(model=str(odd)))


def test_draft_model_problems(tmp_path: Path, stories_dir: str, tiny_model) -> None:
    with pytest.raises(StartupError, match="--draft-model: .*no such directory"):
        resolve(EngineConfig(model=stories_dir, speculative_method="draft", draft_model=str(tmp_path / "x")))
    with pytest.raises(StartupError, match="vocabulary has 320 tokens, the model's 512"):
        resolve(EngineConfig(model=stories_dir, speculative_method="draft", draft_model=tiny_model("llama")))
    ok = resolve(EngineConfig(model=stories_dir, speculative_method="draft", draft_model=stories_dir))
    assert ok.draft_model == stories_dir


def test_tokenizer_and_chat_template_problems(tmp_path: Path, stories_dir: str) -> None:
    no_tokenizer = tmp_path / "m"
    shutil.copytree(stories_dir, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    (no_tokenizer / "tokenizer.model").unlink()
    with pytest.raises(StartupError, match="tokenizer: .* give one with --tokenizer"):
        resolve(EngineConfig(model=str(no_tokenizer)))
    ok = resolve(EngineConfig(model=str(no_tokenizer), tokenizer=stories_dir))  # another tokenizer source
    assert (ok.model, ok.tokenizer, ok.served_model_name) == (str(no_tokenizer), stories_dir, "m")
    with pytest.raises(StartupError, match="--chat-template .* not a valid Jinja template"):
        resolve(EngineConfig(model=stories_dir, chat_template="{% for m in messages %}{{ m }"))
    with pytest.raises(StartupError, match="no such file, and not a Jinja template"):
        resolve(EngineConfig(model=stories_dir, chat_template=str(tmp_path / "chat.jinja")))
    named = resolve(replace(EngineConfig(model=stories_dir), served_model_name="my-model"))
    assert named.served_model_name == "my-model"


def test_up_with_a_wrong_model_prints_one_line_and_starts_nothing(tmp_path: Path) -> None:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "pipeserve.cli", "up", "--model", str(tmp_path / "nope"), "--port",
         str(free_port())],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"pipeserve up: error: --model {tmp_path / 'nope'}: no such directory, and not a Hugging Face hub id "
        "(org/name)"
    ], out.stderr
    assert "started" not in out.stdout + out.stderr and time.monotonic() - start < 60


def test_fp8_is_refused_on_a_gpu_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's compiler refuses fp8 e4m3 below compute capability 8.9 (Ampere): one line at start-up
    rather than a compile error in the engine. Checked with torch's CUDA queries stood in."""
    import torch

    from pipeserve.preflight import check_fp8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (8, 0))
    with pytest.raises(StartupError, match=r"--quantization w8a8-fp8 and --kv-cache-dtype fp8: NVIDIA A100.*"
                       r"\(compute capability 8\.0\).*use --quantization w8a8-int8"):
        check_fp8(EngineConfig(device="cuda", quantization="w8a8-fp8", kv_cache_dtype="fp8"))
    with pytest.raises(StartupError, match="^--kv-cache-dtype fp8: "):
        check_fp8(EngineConfig(device="auto", kv_cache_dtype="fp8"))
    check_fp8(EngineConfig(device="cuda", quantization="w8a8-int8", kv_cache_dtype="int8"))  # int8: any GPU
    check_fp8(EngineConfig(device="cpu", quantization="w8a8-fp8"))  # the cpu backend has its own fp8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))  # Hopper
    check_fp8(EngineConfig(device="cuda:0", quantization="w8a8-fp8", kv_cache_dtype="fp8"))


def test_the_triton_backend_without_triton_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime install leaves Triton out beside a CPU torch: asking for its kernels says so."""
    import importlib.util

    from pipeserve.preflight import check_triton

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(StartupError, match=r"^--backend triton: .*pip install triton, or use --backend cpu$"):
        check_triton(EngineConfig(backend="triton", device="cpu"))
    with pytest.raises(StartupError, match=r"^--device cuda: .*Triton"):
        check_triton(EngineConfig(device="cuda"))
    check_triton(EngineConfig(device="cpu"))  # auto on the CPU: the cpu backend, no Triton
    check_triton(EngineConfig(backend="cpu", device="cuda"))
