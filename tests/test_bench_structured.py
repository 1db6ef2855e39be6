"""`pipeserve bench structured` end to end with a tiny grid: the random ~18M Llama with stories260K's
tokenizer, every variant timed, compile times reported, the JSON written."""

from __future__ import annotations

import argparse
import json

import pytest

from pipeserve.bench import structured

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_bench_structured_writes_every_figure(stories_dir, tmp_path):
    parser = argparse.ArgumentParser()
    structured.add_arguments(parser)
    out = tmp_path / "structured.json"
    args = parser.parse_args(["--batch", "4", "--steps", "4", "--repeats", "1", "--input-len", "8",
                              "--stories", stories_dir, "--json", str(out)])  # fmt: skip
    assert structured.main(args) == 0
    result = json.loads(out.read_text())
    assert result["model"]["vocab_size"] == 512 and result["config"]["constrained_rows"] == 2
    assert set(result["variants"]) == set(structured.VARIANTS)
    for name in structured.VARIANTS[1:]:
        variant = result["variants"][name]
        assert variant["step_ms"] > 0 and variant["step_thread_constraint_ms"] > 0
    assert set(result["compile"]["grammars"]) == set(structured.COMPILE_CASES)
    assert all(row["cold_ms"] > 0 and row["cached_us"] > 0 for row in result["compile"]["grammars"].values())
    first = result["first_request"]
    assert first["new_schema_ttft_ms"] > 0 and first["same_schema_ttft_ms"] > 0 and first["free_ttft_ms"] > 0
