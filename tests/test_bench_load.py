"""`pipeserve bench load`: loads a checkpoint in a fresh process per row and reports what loading
added to the resident set, against the loaded weights."""

from __future__ import annotations

import json

import pytest

from pipeserve import cli
from pipeserve.bench.load import write_random_llama


@pytest.mark.slow
def test_bench_load_writes_its_table(tmp_path) -> None:
    model, out = tmp_path / "model", tmp_path / "out"
    write_random_llama(str(model), 2, hidden=256, inter=512, vocab=1024)  # --random-llama, smaller
    config = json.loads((model / "config.json").read_text())
    assert config["hidden_size"] == 256 and config["num_hidden_layers"] == round((2e6 - 2 * 1024 * 256) / (
        4 * 256 * 256 + 3 * 256 * 512 + 2 * 256))
    argv = ["bench", "load", "--model", str(model), "--dtype", "bfloat16", "--quantization", "none", "w4a16",
            "--out", str(out)]
    assert cli.main(argv) == 0
    rows = json.loads((out / "load.json").read_text())
    assert [(r["dtype"], r["quantization"]) for r in rows] == [("bfloat16", "none"), ("bfloat16", "w4a16")]
    plain, quantized = rows
    assert 0.9 * 2e6 * 2 < plain["weights"] < 1.1 * 2e6 * 2  # about 2M parameters in bf16
    assert quantized["weights"] < plain["weights"]
    for row in rows:
        assert row["peak_rss"] >= row["baseline_rss"] >= row["imported_rss"] > 0
        assert row["added"] == row["peak_rss"] - row["baseline_rss"]
    assert (out / "load.md").read_text().count("\n| bfloat16 |") == 2
