"""`pipeserve bench moe`: the MoE and its dense equivalent hold the parameters they should (the same
active count but the routers, experts / top_k times the MLP weights), and every batch size gets both models'
alternated timings and floors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_moe_tiny(tmp_path):
    out = tmp_path / "moe.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pipeserve.cli", "bench", "moe", "--hidden", "64", "--layers", "2",
         "--experts", "4", "--top-k", "2", "--expert-size", "32", "--batch", "1", "3",
         "--input-len", "4", "--output-len", "3", "--repeats", "2", "--threads", "1",
         "--step-executor", "eager", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    moe, dense = result["models"]["moe"], result["models"]["dense"]
    assert dense["active_params"] == dense["params"]
    assert moe["active_params"] - dense["active_params"] == 2 * 64 * 4  # the routers only
    mlp = 2 * 3 * 64 * 32 * 2  # layers x (gate, up, down) x hidden x expert size x top_k
    assert moe["params"] - moe["active_params"] == mlp  # the two idle experts of 4, per layer
    assert [p["batch"] for p in result["points"]] == [1, 3]
    for p in result["points"]:
        for name in ("moe", "dense"):
            assert len(p[name]["ms_per_step_runs"]) == 2 and p[name]["ms_per_step"] > 0
            assert p[name]["floor_ms_per_step"] > 0
        assert p["moe_over_dense"] == pytest.approx(p["moe"]["ms_per_step"] / p["dense"]["ms_per_step"])
    assert result["points"][0]["experts_touched"] == pytest.approx(2.0)
    assert "MoE / dense" in proc.stdout
