"""`pipeserve bench tp`: every batch size gets alternated step times of TP=1, TP=2 and TP=1 on one
rank's threads, and the step plan's round trip over both transports."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from pipeserve.bench import tp


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_tp_tiny(tmp_path):
    out = tmp_path / "tp.json"
    parser = argparse.ArgumentParser()
    tp.add_arguments(parser)
    args = parser.parse_args(["--hidden", "128", "--layers", "1", "--kv-heads", "1", "--batch", "1", "3",
                              "--input-len", "4", "--output-len", "3", "--repeats", "2", "--threads", "2",
                              "--plan-iters", "5", "--json", str(out)])
    threads = torch.get_num_threads()
    try:
        assert tp.main(args) == 0
    finally:
        torch.set_num_threads(threads)  # the bench sets this process's threads per engine
    result = json.loads(out.read_text())
    assert result["config"]["threads"] == 2 and result["model"]["num_key_value_heads"] == 1
    assert [p["batch"] for p in result["points"]] == [1, 3]
    for p in result["points"]:
        for name in ("tp1", "tp2", "tp1_per_rank"):
            assert len(p[name]["ms_per_step_runs"]) == 2 and p[name]["ms_per_step"] > 0
            assert p[name]["prefill_ms"] > 0
        assert p["tp_over_tp1"] == pytest.approx(p["tp2"]["ms_per_step"] / p["tp1"]["ms_per_step"])
    plans = result["plan_transport"]
    assert [p["batch"] for p in plans] == [1, 3]
    assert plans[1]["payload_bytes"] > plans[0]["payload_bytes"]
    assert all(p["gloo_us"] > 0 and p["zmq_us"] > 0 for p in plans)
