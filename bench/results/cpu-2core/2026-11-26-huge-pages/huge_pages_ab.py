"""Decode steps of the ~76M Llama at batch 1, packed weights and KV pool on huge pages against the same
engine with both on ordinary pages, alternated in one process (one thread; run under taskset -c 1).

    PIPESERVE_SHARED=../shared python bench/results/cpu-2core/2026-11-26-huge-pages/huge_pages_ab.py float32
"""

import statistics
import sys

import torch

from pipeserve.bench.harness import run_batch
from pipeserve.bench.shapes import llama_76m_v512
from pipeserve.bench.workload import shared_dir
from pipeserve.engine import LLM
from pipeserve.engine.backend import native
from pipeserve.engine.kv import pool

dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
torch.set_num_threads(1)
path = llama_76m_v512(shared_dir() / "models" / "stories260K", dtype)
options = {"device": "cpu", "dtype": dtype, "max_num_seqs": 1, "cpu_threads": 1, "prefix_caching": False}
huge = LLM(path, **options)


def ordinary(sizes: list[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=d) for n, d in sizes]


native.huge_page_tensors = pool.huge_page_tensors = ordinary  # the second engine: ordinary pages
plain = LLM(path, **options)
for rnd in range(5):
    ms = {}
    order = (("ordinary", plain), ("huge", huge))
    for name, llm in order if rnd % 2 == 0 else order[::-1]:
        ms[name] = statistics.median(run_batch(llm.engine, [[5] * 16], 256).decode_step_s) * 1e3
    print(f"{dtype} decode step: ordinary pages {ms['ordinary']:.2f} ms, huge pages {ms['huge']:.2f} ms, "
          f"ordinary / huge {ms['ordinary'] / ms['huge']:.3f}", flush=True)
