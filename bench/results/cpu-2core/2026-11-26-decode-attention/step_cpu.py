"""A 64-row decode step of the ~76M Llama in process (64 requests of 128 prompt tokens, steps at
132-172 tokens of context), one thread: the median CPU time of 40 steps on the engine's thread.

    PYTHONPATH=CHECKOUT python step_cpu.py {bfloat16,float32}

The model is the random ~76M Llama that `pipeserve bench step --preset llama76m-decode` builds in the
cache directory (-bfloat16: its bf16 copy, from the bf16 presets).
"""

import statistics
import sys
import time

import torch

from pipeserve.config import cache_dir
from pipeserve.engine import LLM, SamplingParams

torch.set_num_threads(1)
dtype = sys.argv[1]
path = f"{cache_dir()}/random-llama-76m-v512" + ("-bfloat16" if dtype == "bfloat16" else "")
engine = LLM(path, device="cpu", dtype=dtype, max_num_seqs=64, cpu_threads=1, prefix_caching=False,
             kv_cache_gb=2).engine
gen = torch.Generator().manual_seed(0)
params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
for i in range(64):
    engine.add(f"r{i}", torch.randint(3, 500, (128,), generator=gen).tolist(), params)
while engine.scheduler.waiting or any(s.num_output == 0 for s in engine.scheduler.running):
    engine.step()
for _ in range(3):
    engine.step()
times = []
for _ in range(40):
    start = time.thread_time()
    engine.step()
    times.append(time.thread_time() - start)
print(f"{dtype} 64-row decode step, ctx 132-172: CPU time median {statistics.median(times) * 1e3:.1f} ms")
