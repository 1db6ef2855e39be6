"""The ~76M fp32 Llama's batch-1 decode step in process, one thread: median CPU and wall time of 100
steps after 20 (16 prompt tokens, then about 20-120 of context).

    PYTHONPATH=CHECKOUT python batch1_step.py
"""

import statistics
import time

import torch

from pipeserve.config import cache_dir
from pipeserve.engine import LLM, SamplingParams

torch.set_num_threads(1)
engine = LLM(f"{cache_dir()}/random-llama-76m-v512", device="cpu", dtype="float32", max_num_seqs=64,
             cpu_threads=1, prefix_caching=False, kv_cache_gb=2).engine
engine.add("r", list(range(3, 19)), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
for _ in range(20):
    engine.step()
cpu, wall = [], []
for _ in range(100):
    start_cpu, start_wall = time.thread_time(), time.perf_counter()
    engine.step()
    cpu.append(time.thread_time() - start_cpu)
    wall.append(time.perf_counter() - start_wall)
print(f"batch-1 fp32 step: CPU median {statistics.median(cpu) * 1e3:.2f} ms, "
      f"wall median {statistics.median(wall) * 1e3:.2f} ms")
