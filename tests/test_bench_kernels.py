"""`python -m pipeserve.bench.kernels` (the GPU kernel suite): without a GPU it says so and measures nothing;
with --tiny it runs every check at tiny shapes (the interpreter here) and writes its JSON and markdown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GPU = Path("/dev/nvidia0").exists()


def run(*args: str, out: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script decides
    return subprocess.run(
        [sys.executable, "-m", "pipeserve.bench.kernels", *args, "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )


@pytest.mark.skipif(GPU, reason="there is a GPU: the full suite would run")
@pytest.mark.timeout(60)
def test_without_a_gpu_it_says_so(tmp_path):
    proc = run(out=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU here" in proc.stdout and "nothing was measured" in proc.stdout
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_suite_checks_every_kernel(tmp_path):
    proc = run("--tiny", out=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (json_path,) = tmp_path.glob("*/kernels.json")
    report = json.loads(json_path.read_text())
    results = report["results"]
    kernels = {r["kernel"] for r in results}
    for family in (
        "decode_attention[bf16]",
        "decode_attention[int8]",
        "decode_attention[fp8]",
        "prefill_attention",
        "gemm_int8",
        "gemm_fp8",
        "gemm_w4a16[int4]",
        "gemm_w4a16[nf4]",
        "rms_norm+residual+int8",
        "silu_and_mul+int8",
        "rope",
        "store_kv[int8]",
        "fused_moe",
    ):
        assert family in kernels
    assert all(r["error"] is None for r in results), [r["error"] for r in results if r["error"]]
    assert all(r["ok"] for r in results if r["ok"] is not None)
    assert all(r["ms"] and r["ms"] > 0 for r in results)
    assert report["rates"]["copy_bandwidth"] > 0
    md = (json_path.parent / "kernels.md").read_text()
    assert "| kernel | shape | check |" in md and md.count("\n| ") >= len(results)
