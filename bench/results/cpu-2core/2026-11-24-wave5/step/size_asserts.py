"""Inductor's `size_asserts` on and off for the compiled decode steps: two engines on the ~18M random
Llama in one process, batch 1, 128 greedy tokens per request, 8 pairs alternated; ms per token.
Run from the repository root:
    .venv/bin/python bench/results/cpu-2core/2026-11-24-wave5/step/size_asserts.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

from bench.structured import build_model  # noqa: E402
from bench.workload import shared_dir  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402


def engine(model: str, size_asserts: bool) -> Any:
    """An LLM whose compiled steps (built while it starts) take this size_asserts."""
    plain = torch.compile

    def compile_with(fn: Any, **kwargs: Any) -> Any:
        options = {**(kwargs.pop("options", None) or {}), "size_asserts": size_asserts}
        return plain(fn, options=options, **kwargs)

    torch.compile = compile_with  # type: ignore[assignment]
    try:
        return LLM(model, device="cpu", dtype="float32", max_num_seqs=1, cpu_threads=1, prefix_caching=False)
    finally:
        torch.compile = plain


def main() -> None:
    torch.set_num_threads(1)
    model = build_model(shared_dir() / "models" / "stories260K")
    llms = {"asserts": engine(model, True), "no asserts": engine(model, False)}
    params = SamplingParams(max_tokens=128, min_tokens=128, temperature=0.0)
    for llm in llms.values():
        llm.generate([list(range(5, 21))], params)
    ms: dict[str, list[float]] = {name: [] for name in llms}
    for rep in range(8):
        for name in list(llms)[:: 1 if rep % 2 == 0 else -1]:
            start = time.perf_counter()
            llms[name].generate([list(range(5 + rep, 21 + rep))], params)
            ms[name].append((time.perf_counter() - start) / 128 * 1e3)
    ratio = statistics.median(a / b for a, b in zip(ms["asserts"], ms["no asserts"], strict=True))
    print({name: round(statistics.median(v), 3) for name, v in ms.items()}, "asserts / no asserts:",
          round(ratio, 4), "load:", os.getloadavg())


if __name__ == "__main__":
    main()
