"""`pipeserve bench step` on a tiny model: what it counts as the weights a step reads, its probe,
and a short run's JSON and plot (pipeserve eager and HF only: no compile, no llama.cpp build;
figures are not checked: the machine is shared)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from pipeserve.bench import step
from tests.conftest import png_panels


def test_weight_bytes_counts_a_tied_embedding_once_as_the_head(tiny_model) -> None:
    from safetensors import safe_open

    untied, tied = tiny_model("llama"), tiny_model("llama", tie_word_embeddings=True)
    for model_dir in (untied, tied):
        with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
            sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118
        every = sum(4 * a * (b[0] if b else 1) for a, *b in sizes.values())
        embed = 4 * sizes["model.embed_tokens.weight"][0] * sizes["model.embed_tokens.weight"][1]
        # Untied: the embedding is a row lookup, the head is read whole; tied: the one matrix is the head.
        assert step.weight_bytes(model_dir) == (every - embed if model_dir == untied else every)


def test_gemv_probe_reports_the_matrix_bytes_over_the_best_repeat(monkeypatch) -> None:
    """Bytes of the fp32 matrix over the fastest of the timed products (a clock that says how long
    each took; the real one would only say the machine has some bandwidth)."""
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.0])  # repeats of 0.5, 0.25 and 1.0 s
    monkeypatch.setattr(step.time, "perf_counter", lambda: next(ticks))
    n = int((8 * 2**20 / 4) ** 0.5)  # the side of an 8 MiB square fp32 matrix
    assert step.gemv_bandwidth(megabytes=8, repeats=3) == n * n * 4 / 0.25 / 1e9
    assert next(ticks, None) is None  # one clock reading before and after each repeat, no more


@pytest.mark.slow  # the profiler and the plot: ~12 s
def test_bench_step_writes_figures_for_each_system_and_batch(tiny_model, tmp_path) -> None:
    parser = argparse.ArgumentParser()
    step.add_arguments(parser)
    args = parser.parse_args(["--model", tiny_model("llama"), "--batch-sizes", "1,2", "--prompt-len", "4",
                              "--new-tokens", "3", "--repeats", "2", "--profile-steps", "2",
                              "--systems", "pipeserve eager,hf generate",
                              "--json", str(tmp_path / "s.json"),
                              "--plot", str(tmp_path / "s.png")])  # fmt: skip
    assert step.main(args) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert set(result["batches"]) == {"1", "2"}
    for row in result["batches"].values():
        assert set(row) == {"pipeserve eager", "hf generate"}
        assert row["hf generate"]["same_tokens"] is True and row["hf generate"]["same_requests"] == 1.0
        eager = row["pipeserve eager"]
        assert len(eager["repeats_e2e_s"]) == len(eager["repeats_prefill_s"]) == 2
        assert eager["e2e_s"] > eager["prefill_s"] > 0 and eager["decode_ms_per_step"] > 0
        profile = row["pipeserve eager"]["profile"]
        assert profile["step_ms"] >= profile["host_ms"] >= 0 and profile["compute_ms"] > 0
    assert result["reference"] == "pipeserve eager"
    assert result["floor_ms_per_step"] == result["weight_bytes"] / result["gemv_GBps"] / 1e6
    assert png_panels(tmp_path / "s.png") == 2  # end to end, decode steps


def test_profile_of_steps_wider_than_the_native_step_counts_their_operators(tiny_model) -> None:
    # A native executor's wider steps (from the row count where oneDNN's GEMM wins) run per op: their
    # operators are profiled, not read off the native step's timer (which they never touch).
    from pipeserve.engine import LLM
    from pipeserve.engine.executor.native import NativeExecutor

    llm = LLM(tiny_model("llama"), device="cpu", prefix_caching=False)
    executor = llm.engine.runner.executor
    assert isinstance(executor, NativeExecutor)
    executor.max_rows = 1
    profile = step.host_overhead_ms(llm, [[1, 5, 9], [1, 7, 8]], steps=2)
    assert profile["compute_ms"] > 0 and profile["step_ms"] >= profile["host_ms"] >= 0
