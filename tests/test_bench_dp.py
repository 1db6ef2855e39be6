"""`pipeserve bench dp`: one round against --data-parallel-size 1 and 2 (real servers, tiny workload)."""

from __future__ import annotations

import json

import pytest

from pipeserve import cli
from tests.conftest import STORIES

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not (STORIES / "config.json").is_file(), reason=f"stories260K not found at {STORIES}"),
]


def test_one_round_reports_each_size_and_both_engines_served(tmp_path) -> None:
    out = tmp_path / "dp.json"
    argv = ["bench", "dp", "--model", str(STORIES), "--repeats", "1", "--num-requests", "12", "--rate", "inf",
            "--input-len", "8", "--output-len", "4", "--tokenizer-workers", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    assert [(r["size"], r["summary"]["completed"]) for r in result["runs"]] == [(1, 12), (2, 12)]
    assert result["runs"][0]["routed"] == [12] and sum(result["runs"][1]["routed"]) == 12
    assert min(result["runs"][1]["routed"]) >= 3  # both engines took requests
    assert set(result["medians"]) == {"1", "2"} and result["medians"]["2"]["req/s"] > 0
