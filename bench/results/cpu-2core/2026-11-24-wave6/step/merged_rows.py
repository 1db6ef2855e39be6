"""Prefill of one prompt as native rows against the eager per-op path, by prompt length: the
measurement behind compiled_step.NATIVE_MERGED_ROWS. The ~18M Llama fp32, one thread, one request
generating one token, the two engines alternated 5 times per length; medians in ms.

    .venv/bin/python bench/results/cpu-2core/2026-11-24-wave6/step/merged_rows.py
"""

import statistics
import time
from pathlib import Path

import torch
from bench.structured import build_model
from bench.workload import shared_dir
from services.engine import LLM, SamplingParams, compiled_step

torch.set_num_threads(1)
compiled_step.NATIVE_MERGED_ROWS = 1024  # every length below runs native in the compiled engine
model = build_model(Path(shared_dir()) / "models" / "stories260K")
engines = {name: LLM(model, device="cpu", dtype="float32", compile=name == "native", max_num_seqs=1,
                     cpu_threads=1, prefix_caching=False, max_num_batched_tokens=1024)
           for name in ("native", "eager")}
params = SamplingParams(max_tokens=1, temperature=0.0)
for length in (16, 64, 128, 256, 512):
    ms: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(5):
        for name, llm in engines.items():
            prompt = [(7 * i + r) % 500 + 3 for i in range(length)]  # fresh each repeat
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            ms[name].append((time.perf_counter() - start) * 1e3)
    native, eager = statistics.median(ms["native"]), statistics.median(ms["eager"])
    print(f"{length:4d} tokens: native {native:6.1f} ms  eager {eager:6.1f} ms  ratio {native / eager:.2f}")
