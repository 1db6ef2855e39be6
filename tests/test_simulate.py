"""The serving simulator: the real Scheduler and KV pool driven by a step-time model."""

from __future__ import annotations

import json
import random

import pytest

from pipeserve import cli
from pipeserve.bench.workload import TraceRequest
from pipeserve.capacity.gpus import GPU
from pipeserve.capacity.roofline import ModelShape, cost_model
from pipeserve.capacity.simulator import (
    LinearStepTime,
    RooflineStepTime,
    ServeSpec,
    at_rate,
    features,
    find_capacity,
    fits,
    make_sequence,
    policy_factory,
    simulate,
    train,
)
from tests.conftest import png_panels

pytestmark = pytest.mark.timeout(60)

COST = cost_model(ModelShape.preset("llama-3-8b"), GPU.get("H100-SXM"))
STEP = RooflineStepTime(COST, efficiency=0.8)


def two_apps(n: int, seed: int, rate: float = 40.0) -> list[TraceRequest]:
    """A short-answer app and a long-answer app, Poisson arrivals."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        app = rng.choice(["short", "long"])
        output = rng.randint(5, 30) if app == "short" else rng.randint(200, 400)
        out.append(TraceRequest(t, rng.randint(200, 1200), output, app))
    return out


def test_at_rate_keeps_order_and_sets_the_mean_rate():
    reqs = two_apps(100, seed=0)
    scaled = at_rate(reqs, 5.0)
    assert scaled[0].arrival == 0.0
    assert (len(scaled) - 1) / scaled[-1].arrival == pytest.approx(5.0)
    assert [r.prompt_tokens for r in scaled] == [r.prompt_tokens for r in reqs]
    assert all(a.arrival <= b.arrival for a, b in zip(scaled, scaled[1:], strict=False))


def test_requests_ask_what_fits_in_the_context():
    spec = ServeSpec(num_pages=1000, context=8192, max_tokens=2048)
    assert make_sequence("a", TraceRequest(0, 1000, 5, "x"), spec).params.max_tokens == 2048
    assert make_sequence("b", TraceRequest(0, 7000, 5, "x"), spec).params.max_tokens == 1192
    assert fits(TraceRequest(0, 8191, 5, "x"), spec)
    assert not fits(TraceRequest(0, 8192, 5, "x"), spec)
    assert not fits(TraceRequest(0, 5000, 5, "x"), ServeSpec(num_pages=100))  # larger than the pool


def test_policies_side_by_side_on_a_memory_bound_pool():
    spec = ServeSpec(num_pages=1024)  # 16k tokens: about 16 requests' KV
    predictor = train(features(two_apps(2000, seed=1), spec))
    reqs = two_apps(300, seed=2)
    runs = {name: simulate(reqs, policy_factory(name, predictor, 0.9)(), STEP, spec)
            for name in ("max", "optimistic", "predicted", "predicted-reserve")}
    for name, run in runs.items():
        s = run.summary
        assert s["completed"] == 300, name
        # The fake model emits EOS where the trace says the answer ended.
        assert [r.output_tokens for r in run.records] == [r.output_tokens for r in reqs]
        assert all(r.ttft > 0 and r.chunk_times == sorted(r.chunk_times) for r in run.records)
        assert 0 < s["kv"]["used"] <= s["kv"]["allocated"] <= s["kv"]["reserved"] <= 1
        assert s["queue_s"]["count"] == 300
    m, o, p, r = (runs[n].summary for n in ("max", "optimistic", "predicted", "predicted-reserve"))
    assert m["preemptions"] == m["recomputed_tokens"] == 0
    assert o["preemptions"] > 0 and o["recomputed_tokens"] > 0
    assert p["preemptions"] < o["preemptions"] / 2 and r["preemptions"] < o["preemptions"] / 2
    # Promising whole outputs up front wastes KV; the future-peak check promises only prompts.
    assert m["kv"]["waste"] > r["kv"]["waste"] > 0.1 > 0.05 > p["kv"]["waste"]
    assert p["ttft_s"]["p50"] < r["ttft_s"]["p50"] < m["ttft_s"]["p50"]  # max queues behind its promises


def test_roofline_and_fitted_step_times():
    decode, chunks = [100, 2000, 513], [(256, 0), (64, 1024)]
    assert STEP(decode, chunks) == pytest.approx(COST.step(decode, chunks).t / 0.8)
    with_overhead = RooflineStepTime(COST, 1.0, 0.002)
    assert with_overhead([], [(1, 0)]) == pytest.approx(COST.step([], [(1, 0)]).t + 0.002)
    truth = LinearStepTime(0.004, 2e-5, 3e-8, 1e-10)
    rng = random.Random(3)
    samples = []
    for _ in range(50):
        d = [rng.randint(1, 4000) for _ in range(rng.randint(0, 64))]
        p = [(rng.randint(1, 512), rng.randint(0, 2000)) for _ in range(rng.randint(0, 3))]
        samples.append((d, p, truth(d, p)))
    fitted = LinearStepTime.fit(samples)
    for d, p, t in samples:
        assert fitted(d, p) == pytest.approx(t, rel=1e-6)


def test_capacity_search_brackets_the_knee():
    def run(rate: float):
        class R:
            summary = {"slo_attainment": 1.0 if rate <= 7.3 else 0.5, "goodput": rate}
        return R()

    best, points = find_capacity(run, start=2.0, target=0.9)
    assert 7.3 / 1.03 <= best <= 7.3
    assert len(points) <= 14 and points == sorted(points, key=lambda p: p["rate"])
    assert find_capacity(lambda r: run(1e9), start=2.0, target=0.9)[0] is None


@pytest.mark.slow  # the whole trace through the CLI: ~4 s
def test_cli_on_the_mixed_azure_trace(traces_dir, tmp_path, capsys):
    out = tmp_path / "sim.json"
    code = cli.main(["simulate", "--gpu", "H100-SXM", "--kv-gib", "2", "--context", "4096",
                     "--requests", "150", "--rate", "6", "--capacity", "--quantile", "0.5,0.9",
                     "--json", str(out), "--out", str(tmp_path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "policies side by side" in printed and "capacity" in printed
    result = json.loads(out.read_text())
    assert [r["policy"] for r in result["runs"]] == ["max", "optimistic", "predicted q0.5", "predicted q0.9"]
    assert result["trace"]["window_requests"] == 150
    assert result["trace"]["dropped_beyond_context_or_pool"] > 0  # 4k context: long code prompts are dropped
    acc = result["predictor"]
    assert acc["predicted"]["mae_p50"] < acc["prompt_length_only"]["mae_p50"]
    assert acc["predict_us"] > 0 and acc["keys"] > 0
    assert set(result["capacity"]) == {r["policy"] for r in result["runs"]}
    assert all(c["rate"] is None or c["rate"] > 0 for c in result["capacity"].values())
    assert png_panels(tmp_path / "simulate.png") == 2 and png_panels(tmp_path / "capacity.png") == 1
