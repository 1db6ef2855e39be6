"""One native decode attention call, timed: 64 rows, 12 query / 4 KV heads of 64, CTX keys each,
pages of 16 scattered at random; median of REPS calls, one thread, in CPU time (the
calling thread's: the shared machine's load does not count). FLUSH=1 streams 256 MB between
calls (the KV then comes from memory, as in a model's step).

    python attention_call.py {fp32,bf16} CTX [REPS]
"""

import os
import sys
import time

import torch

from pipeserve.engine.backend import native

torch.set_num_threads(1)
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
ctx = int(sys.argv[2])
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 50
rows, q_heads, kv_heads, dim, page = 64, 12, 4, 64, 16
pages_per_row = -(-ctx // page)
gen = torch.Generator().manual_seed(0)
k_cache = torch.randn(rows * pages_per_row, page, kv_heads, dim, generator=gen).to(dtype)
v_cache = torch.randn(rows * pages_per_row, page, kv_heads, dim, generator=gen).to(dtype)
tables = torch.randperm(rows * pages_per_row, generator=gen).int().view(rows, pages_per_row).contiguous()
lens = torch.full((rows,), ctx, dtype=torch.int32)
q = torch.randn(rows, q_heads, dim, generator=gen)
assert native.available()
flush = torch.zeros(64 << 20) if os.environ.get("FLUSH") else None
for _ in range(5):
    native.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, None)
times = []
for _ in range(reps):
    if flush is not None:
        flush.add_(1.0)
    start = time.thread_time()
    native.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, None)
    times.append(time.thread_time() - start)
times.sort()
print(f"{sys.argv[1]} ctx {ctx}: median {times[len(times) // 2] * 1e3:.3f} ms, min {times[0] * 1e3:.3f} ms")
