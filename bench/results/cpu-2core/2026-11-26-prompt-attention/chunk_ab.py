"""A later chunk of a prompt (512 queries after its first tokens, over all its keys), 12 query / 4 KV
heads of 64, bf16: the AMX prompt kernel against the cpu backend's SDPA call with a mask (the path
such chunks took before), alternated, one thread (run under taskset -c 1).

    python bench/results/cpu-2core/2026-11-26-prompt-attention/chunk_ab.py
"""

import timeit

import torch

from pipeserve.engine.backend import cpu, native

torch.set_num_threads(1)
assert native.available()
heads, kv_heads, dim = 12, 4, 64


def ms(fn) -> float:
    """Milliseconds a call, over 5 calls after one to warm up."""
    fn()
    return timeit.timeit(fn, number=5) / 5 * 1e3


for length, later in ((2048, 1536), (1024, 512)):
    qkv = torch.randn(length, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    q = qkv[later:, :heads * dim].view(length - later, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(length, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(length, kv_heads, dim)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    sees = torch.arange(length)[None, :] <= torch.arange(later, length)[:, None]
    for _ in range(3):
        kernel = ms(lambda: native.prompt_attention(q, k, v, 0.125, out))  # noqa: B023
        sdpa = ms(lambda: cpu._sdpa(q[None], k[None], v[None], sees, 0.125))  # noqa: B023
        print(f"{length - later} queries after {later}: kernel {kernel:.2f} ms, "
              f"SDPA with a mask {sdpa:.2f} ms, {sdpa / kernel:.2f}x", flush=True)
