"""Merged prefill + decode steps, eager (what the engine runs) against torch.compile with dynamic
shapes, on the ~18M random Llama, one thread, alternated in one process.

Two ways to compile a step with prefill rows:
- the whole forward pass, dynamic=True (as the decode buckets, but with every size symbolic);
- the dense blocks only (every MLP and RMSNorm), dynamic=True, attention and the KV store eager.

Decode-only steps run in the compiled buckets in every variant; only steps with prefill rows are
timed. Greedy tokens must match. Run from the repository root:
    .venv/bin/python bench/results/cpu-2core/2026-11-24-wave5/step/merged_compile.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

from bench.structured import build_model  # noqa: E402
from bench.workload import shared_dir  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.compiled_step import _FORWARD  # noqa: E402
from services.engine.model.llama import MLP, RMSNorm  # noqa: E402

REQUESTS, MAX_NUM_SEQS, REPEATS = 24, 8, 4


def workload(rng: np.random.Generator) -> tuple[list[list[int]], list[SamplingParams]]:
    lens, outs = rng.integers(20, 200, REQUESTS), rng.integers(8, 40, REQUESTS)
    prompts = [rng.integers(3, 512, int(n)).tolist() for n in lens]
    return prompts, [SamplingParams(max_tokens=int(o), min_tokens=int(o), temperature=0.0) for o in outs]


def compile_dense(llm: Any) -> None:
    """Every MLP and RMSNorm of the eager path through torch.compile(dynamic=True); the decode
    buckets, which trace through the same modules, keep tracing the plain forward."""
    for module in llm.engine.runner.model.modules():
        if isinstance(module, (MLP, RMSNorm)):
            plain = module.forward
            compiled = torch.compile(plain, dynamic=True)

            def forward(*args: Any, _plain: Any = plain, _compiled: Any = compiled) -> Any:
                return _plain(*args) if torch.compiler.is_compiling() else _compiled(*args)

            setattr(module, "forward", forward)  # noqa: B010 (an instance attribute over the method)


def compile_whole(llm: Any) -> None:
    runner = llm.engine.runner
    model, pool = runner.model, runner.pool
    def forward(ids: torch.Tensor, pos: torch.Tensor, meta: Any, views: Any) -> Any:
        return _FORWARD(model, ids, pos, meta, views)

    compiled = torch.compile(forward, dynamic=True)

    class Whole:
        def __call__(self, ids: torch.Tensor, pos: torch.Tensor, meta: Any, layers: Any) -> Any:
            return compiled(ids, pos, meta, pool.layer_views())

        def __getattr__(self, name: str) -> Any:
            return getattr(model, name)

    runner.model = Whole()


def timed_prefill_steps(llm: Any) -> list[float]:
    """Seconds of each runner step that had prefill rows (appended as they run)."""
    runner, seconds = llm.engine.runner, []
    forward = runner.forward

    def timed(batch: Any) -> Any:
        start = time.perf_counter()
        out = forward(batch)
        if batch.prefill:
            seconds.append(time.perf_counter() - start)
        return out

    runner.forward = timed
    return seconds


def main() -> None:
    torch.set_num_threads(1)
    model = build_model(shared_dir() / "models" / "stories260K")
    results: dict[str, Any] = {"loadavg_start": os.getloadavg()}
    llms: dict[str, Any] = {}
    for variant in ("eager", "whole", "dense"):
        llm = LLM(model, device="cpu", dtype="float32", max_num_seqs=MAX_NUM_SEQS, cpu_threads=1,
                  prefix_caching=False)
        if variant != "eager":
            (compile_whole if variant == "whole" else compile_dense)(llm)
        llms[variant] = (llm, timed_prefill_steps(llm))
    rng = np.random.default_rng(0)
    runs: dict[str, list[float]] = {}
    for rep in range(REPEATS + 1):  # the first: warm-up (compiles)
        prompts, params = workload(rng)
        tokens: dict[str, list[list[int]]] = {}
        for variant in list(llms)[rep % 3:] + list(llms)[: rep % 3]:
            llm, seconds = llms[variant]
            if variant in results.get("failed", {}):
                continue
            del seconds[:]
            try:
                tokens[variant] = [o.token_ids for o in llm.generate(prompts, params)]
            except Exception as err:  # an Inductor failure is the finding: record it
                results.setdefault("failed", {})[variant] = f"{type(err).__name__}: {str(err)[:300]}"
                continue
            if rep:
                runs.setdefault(variant, []).append(sum(seconds))
        assert all(t == tokens["eager"] for t in tokens.values()), "greedy tokens differ"
    results["prefill_step_seconds"] = runs
    results["median_over_eager"] = {v: statistics.median(a / b for a, b in zip(r, runs["eager"], strict=True))
                                    for v, r in runs.items()}
    results["loadavg_end"] = os.getloadavg()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
