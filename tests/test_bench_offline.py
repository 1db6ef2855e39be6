"""`pipeserve bench offline`: the static-batch waste figure by hand, and a tiny run end to end."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pipeserve.bench.offline import Workload
from pipeserve.cli import main
from pipeserve.config import EngineConfig
from pipeserve.cpus import engine_core_count

pytestmark = pytest.mark.timeout(120)


def test_static_batch_waste_by_hand() -> None:
    work = Workload(prompts=[[1] * 10, [1] * 2, [1] * 4, [1] * 4], outputs=[1, 5, 2, 2])
    # Batch 1 runs 2 x (10 + 5) positions and batch 2 runs 2 x (4 + 2), for these needed ones:
    needed = (10 + 1) + (2 + 5) + (4 + 2) + (4 + 2)
    assert work.static_batch_waste(2) == pytest.approx((2 * 15 + 2 * 6) / needed)
    assert work.static_batch_waste(1) == pytest.approx(1.0)


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_bench_offline_end_to_end(stories_dir: str, tmp_path, keep_threads) -> None:
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", stories_dir, "--num-requests", "4", "--batch-size", "2",
            "--repeats", "2", "--overhead-requests", "8", "--overhead-context", "64", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    # Both engines at the engine's own thread count for this host unless --threads says otherwise.
    assert result["threads"] == engine_core_count(EngineConfig(), len(os.sched_getaffinity(0)))
    (entry,) = result["models"]
    assert entry["output_tokens"] > 0 and entry["pipeserve_tok_s"] > 0 and entry["hf_tok_s"] > 0
    assert entry["speedup"] == pytest.approx(entry["hf_s"] / entry["pipeserve_s"])
    assert entry["static_batch_waste"] >= 1.0
    assert len(entry["pipeserve_runs_s"]) == len(entry["hf_runs_s"]) == 2
    assert 0 < result["scheduler_overhead_ms_per_step"] < 100
