"""bf16 prefill of 64 x 512 tokens on the ~76M Llama (random weights, vocab 512) in one engine, one
thread, the prompt kernel on and off (SDPA) alternated by run; first tokens compared.

    cd bench/results/cpu-2core/2026-11-26-prompt-attention
    PIPESERVE_SHARED=../../../../../shared taskset -c 1 python prefill_ab.py
"""

import time

import numpy as np
import torch

from pipeserve.bench.harness import run_batch
from pipeserve.bench.shapes import llama_76m_v512
from pipeserve.bench.workload import shared_dir
from pipeserve.engine import LLM
from pipeserve.engine.backend import native

torch.set_num_threads(1)
path = llama_76m_v512(shared_dir() / "models" / "stories260K", "bfloat16")
llm = LLM(path, device="cpu", dtype="bfloat16", max_num_seqs=64, cpu_threads=1, prefix_caching=False,
          kv_cache_gb=2)
prompts = np.random.default_rng(0).integers(0, 512, size=(64, 512)).tolist()
kernel = native.supports_prompt_attention
first: dict[str, list[list[int]]] = {}
for rnd in range(4):
    for name in ("kernel", "sdpa") if rnd % 2 == 0 else ("sdpa", "kernel"):
        native.supports_prompt_attention = kernel if name == "kernel" else (lambda *a: False)
        start = time.perf_counter()
        first[name] = run_batch(llm.engine, prompts, 1).outputs
        print(f"{name}: {time.perf_counter() - start:.2f} s", flush=True)
same = sum(a == b for a, b in zip(first["kernel"], first["sdpa"], strict=True))
print(f"same first token: {same} of 64 prompts")
