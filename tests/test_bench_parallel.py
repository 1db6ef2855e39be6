"""`pipeserve simulate --parallel`: the tensor-parallel step model (sharded roofline plus collectives)
and data-parallel replays."""

from __future__ import annotations

import json

import pytest

from pipeserve import cli
from pipeserve.capacity.gpus import GPU
from pipeserve.capacity.parallel import (
    INTERCONNECTS,
    TensorParallelStepTime,
    parse_layouts,
    replay_data_parallel,
    sharded,
)
from pipeserve.capacity.roofline import ModelShape, cost_model
from pipeserve.capacity.simulator import RooflineStepTime, ServeSpec, at_rate, policy_factory
from tests.test_simulate import two_apps

pytestmark = pytest.mark.timeout(60)

SHAPE = ModelShape.preset("llama-3-8b")
COST = cost_model(SHAPE, GPU.get("H100-SXM"))
LINK = INTERCONNECTS["nvlink4"]


def tp_step(ranks: int, link=LINK) -> TensorParallelStepTime:
    return TensorParallelStepTime(sharded(COST, SHAPE, ranks), ranks, link, SHAPE.hidden_size,
                                  SHAPE.num_layers, SHAPE.vocab_size)


def test_collectives_cost_nothing_on_one_gpu_and_the_ring_formula_beyond() -> None:
    assert LINK.all_reduce(1e6, 1) == LINK.all_gather(1e6, 1) == 0.0
    assert LINK.all_reduce(1e6, 2) == pytest.approx(LINK.latency + 1e6 / LINK.bandwidth)
    assert LINK.all_reduce(1e6, 8) == pytest.approx(LINK.latency + 2 * 7 / 8 * 1e6 / LINK.bandwidth)
    assert LINK.all_gather(1e6, 4) == pytest.approx(LINK.latency + 3 / 4 * 1e6 / LINK.bandwidth)


def test_a_shard_reads_its_share_and_kv_heads_replicate_past_their_count() -> None:
    two = sharded(COST, SHAPE, 2)
    assert two.weight_bytes == pytest.approx(COST.weight_bytes / 2)
    assert two.gemm_flops_per_token == pytest.approx(COST.gemm_flops_per_token / 2)
    assert two.kv_bytes_per_token == pytest.approx(COST.kv_bytes_per_token / 2)  # 8 KV heads: 4 each
    # 8 KV heads over 16 ranks: each rank keeps one whole head, as with 8 ranks.
    assert sharded(COST, SHAPE, 16).kv_bytes_per_token == pytest.approx(COST.kv_bytes_per_token / 8)
    assert sharded(COST, SHAPE, 2).kv_capacity_tokens() > 2 * COST.kv_capacity_tokens()  # weights shrank too


def test_tp_step_is_the_roofline_on_one_gpu_and_trades_compute_for_collectives() -> None:
    assert tp_step(1)([1024] * 8, [(256, 0)]) == pytest.approx(RooflineStepTime(COST)([1024] * 8, [(256, 0)]))
    assert tp_step(1).communication(64, 64) == 0.0
    # Batch-1 decode is memory bound: TP=4 reads a quarter of the weights per GPU, minus the collectives.
    assert tp_step(4)([1024], []) < tp_step(2)([1024], []) < tp_step(1)([1024], [])
    assert tp_step(4).communication(1, 1) == pytest.approx(2 * 32 * LINK.all_reduce(4096 * 2, 4)
                                                           + LINK.all_gather(128256 * 2, 4))
    # On a slow link the collectives eat the gain.
    slow = INTERCONNECTS["pcie5"].__class__("slow", 5e9, 200e-6)
    assert tp_step(4, slow)([1024], []) > tp_step(1)([1024], [])


def test_data_parallel_replays_every_request_and_halves_the_queue() -> None:
    requests = at_rate(two_apps(120, seed=3), 60.0)
    spec = ServeSpec(num_pages=4000, context=4096, max_num_seqs=8)
    make = policy_factory("optimistic", None, 0.9)
    one = replay_data_parallel(requests, 1, make, tp_step(1), spec)
    two = replay_data_parallel(requests, 2, make, tp_step(1), spec)
    assert one["completed"] == two["completed"] == 120
    assert two["ttft_s"]["p50"] < one["ttft_s"]["p50"]


def test_parse_layouts() -> None:
    assert parse_layouts("8x1, 4X2,1x8") == [(8, 1), (4, 2), (1, 8)]
    for bad in ("8", "0x2", "2x", "axb"):
        with pytest.raises(ValueError):
            parse_layouts(bad)


def test_cli_reports_each_layout_and_which_do_not_fit(tmp_path, traces_dir) -> None:
    out = tmp_path / "parallel.json"
    argv = ["simulate", "--parallel", "8x1,2x4", "--model", "llama-3-70b", "--gpu", "H100-SXM",
            "--requests", "60", "--rate", "4", "--json", str(out)]
    assert cli.main(argv) == 0
    layouts = json.loads(out.read_text())["layouts"]
    assert [(e["dp"], e["tp"], e["fits"]) for e in layouts] == [(8, 1, False), (2, 4, True)]
    assert layouts[1]["at_rate"]["completed"] == 60 and layouts[1]["decode_step_ms"]["batch_1"] > 0
