"""`pipeserve bench gemm`: both CPU products timed by row count, the crossover table written for this
host's CPU class (other classes kept), and recomputed from a saved run."""

from __future__ import annotations

import json

import pytest
import torch

from pipeserve import cli
from pipeserve.engine.backend import cpu_gemm, native

pytestmark = pytest.mark.skipif(not native.available() or not cpu_gemm.available(),
                                reason="needs the native kernels and torch with oneDNN")


@pytest.mark.slow  # torch.matmul's large product in every round
def test_bench_gemm_writes_the_table_and_recomputes_it(tmp_path, monkeypatch) -> None:
    table = tmp_path / "cpu_gemm_table.json"
    table.write_text(json.dumps({"other-class": {"commands": {}, "entries": []}}))
    monkeypatch.setattr(cpu_gemm, "TABLE", table)
    out = tmp_path / "gemm.json"
    argv = ["bench", "gemm", "--shapes", "512x256", "--rows", "1,4", "--repeats", "1", "--with-matmul",
            "--json", str(out), "--write-table"]
    assert cli.main(argv) == 0
    run = json.loads(out.read_text())
    assert [(e["dtype"], e["n"], e["k"], e["rows"]) for e in run["shapes"]] == [
        ("float32", 512, 256, [1, 4]), ("bfloat16", 512, 256, [1, 4])]
    assert all(len(e["matmul_GFLOPs"]) == 2 and len(e["best_over_matmul"]) == 2 for e in run["shapes"])
    written = json.loads(table.read_text())
    mine = written[cpu_gemm.cpu_class()]
    assert "other-class" in written
    assert all(mine["commands"][d].startswith("pipeserve bench gemm --shapes 512x256")
               for d in ("float32", "bfloat16"))
    assert [e["gemm_from"] for e in mine["entries"]] == [e["gemm_from"] for e in run["shapes"]]
    # One dtype measured again: the other dtype's entries and command stay.
    bf16_only = ["bench", "gemm", "--shapes", "512x256", "--rows", "1,4", "--repeats", "1",
                 "--dtypes", "bfloat16", "--json", str(tmp_path / "bf16.json"), "--write-table"]
    assert cli.main(bf16_only) == 0
    again = json.loads(table.read_text())[cpu_gemm.cpu_class()]
    assert [e for e in again["entries"] if e["dtype"] == "float32"] == mine["entries"][:1]
    assert [e["dtype"] for e in again["entries"]] == ["float32", "bfloat16"]
    assert again["commands"]["float32"] == mine["commands"]["float32"]
    assert "--dtypes bfloat16" in again["commands"]["bfloat16"]
    # The crossovers again from the saved run, nothing measured: the same entries.
    table.write_text("{}")
    assert cli.main(["bench", "gemm", "--from-json", str(out), "--write-table"]) == 0
    assert json.loads(table.read_text())[cpu_gemm.cpu_class()]["entries"] == mine["entries"]


@pytest.mark.skipif(cpu_gemm.available(torch.bfloat16), reason="this CPU has oneDNN's bf16 GEMM")
def test_bench_gemm_times_the_packed_product_alone_where_onednn_has_no_bf16(tmp_path, capsys) -> None:
    out = tmp_path / "out.json"
    assert cli.main(["bench", "gemm", "--shapes", "512x256", "--rows", "1,16", "--dtypes", "bfloat16",
                     "--repeats", "1", "--json", str(out)]) == 0
    assert "oneDNN has no torch.bfloat16 GEMM on this CPU" in capsys.readouterr().out
    (entry,) = json.loads(out.read_text())["shapes"]
    assert entry["gemm_us"] == [None, None] and entry["gemm_GFLOPs"] == [None, None]
    assert entry["gemm_from"] is None  # the packed product at every row count
    assert all(p > 0 for p in entry["packed_GFLOPs"]) and len(entry["best_over_matmul"]) == 2
