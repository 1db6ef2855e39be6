"""`pipeserve bench cpu-ops` on small shapes: every row of both tables measured and written (figures
are not checked: the machine is shared)."""

from __future__ import annotations

import argparse
import json
import os
import shutil

import pytest

from pipeserve.bench import cpu_ops


@pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None, reason="no C++ compiler")
@pytest.mark.slow  # times every op: ~2 s
def test_bench_cpu_ops_writes_both_tables(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    cpu_ops.add_arguments(parser)
    args = parser.parse_args(["--linear-shapes", "64x32,1024x512", "--rows", "1,8", "--repeats", "1",
                              "--json", str(tmp_path / "ops.json")])
    assert cpu_ops.main(args) == 0
    data = json.loads((tmp_path / "ops.json").read_text())
    assert [(r["n"], r["rows"]) for r in data["linear"]] == [(64, 1), (64, 8), (1024, 1), (1024, 8)]
    assert all(r["f_linear_us"] > 0 and r["native_us"] > 0 for r in data["linear"])
    assert len(data["decode_attention"]) == len(cpu_ops.ATTENTION)
    assert all(r["native_us"] > 0 and r["torch_us"] > 0 for r in data["decode_attention"])


@pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None, reason="no C++ compiler")
def test_bench_cpu_ops_runs_only_the_ops_named(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    cpu_ops.add_arguments(parser)
    args = parser.parse_args(["--ops", "attention", "--repeats", "1", "--json", str(tmp_path / "ops.json")])
    assert cpu_ops.main(args) == 0
    data = json.loads((tmp_path / "ops.json").read_text())
    assert data["linear"] == [] and {r["dtype"] for r in data["decode_attention"]} == {"float32", "bfloat16"}
    assert "linear:" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--ops"):
        cpu_ops.main(parser.parse_args(["--ops", "gemm"]))
