"""`pipeserve bench pipeline`: a very short run of the whole command (a 1-layer model, a few requests;
part 2 drives its synthetic engine through the real engine loop and gateway) that must print every
figure and write them as JSON and PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import png_panels

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_short_run_prints_every_figure_and_writes_json(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pipeserve.cli", "bench", "pipeline", "--num-layers", "1", "--requests", "3",
         "--concurrency", "2", "--input-len", "4", "--output-len", "3", "--rounds", "1",
         "--ttft-requests", "2",
         "--ttft-output-len", "2", "--capacity-streams", "1", "4", "--capacity-output-len", "8",
         "--json", str(tmp_path / "p.json"), "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for figure in ("pipeline / in-process tokens/s", "added TTFT p50 ms", "tokens/message", "load average"):
        assert figure in out.stdout
    result = json.loads((tmp_path / "p.json").read_text())
    p1, p2 = result["part1"], result["part2"]
    assert p1["in_process"]["output_tokens"] == p1["pipeline"]["output_tokens"] == 9
    assert p1["throughput_ratio"] == pytest.approx(
        p1["pipeline"]["output_throughput"] / p1["in_process"]["output_throughput"]
    )
    assert len(p1["rounds"]) == 1 and p1["rounds"][0]["ratio"] == pytest.approx(
        p1["throughput_ratio"], rel=0.01
    )
    t = p1["ttft_low_load"]
    assert len(t["in_process_s"]) == len(t["pipeline_s"]) == 2
    assert t["added_p50_s"] == pytest.approx(t["pipeline_p50_s"] - t["in_process_p50_s"])
    assert [r["streams"] for r in p2["runs"]] == [1, 4]
    assert [r["output_tokens"] for r in p2["runs"]] == [8, 32]
    assert p2["tokens_per_s_at_max_streams"] == p2["runs"][-1]["tokens_per_s"] > 0
    load = result["machine"]["load_average"]
    assert set(load) == {"start", "round_0", "ttft", "capacity_1", "capacity_4", "end"}
    assert png_panels(tmp_path / "pipeline.png") == 3  # TTFT CDF, throughput, gateway capacity
