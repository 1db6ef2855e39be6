"""One layer's causal attention of a 512-token prompt (12 query heads, 4 KV heads, head_dim 64, bf16,
rows strided as a fused projection leaves them): the AMX prompt kernel against torch's SDPA (its
CPU flash kernel), alternated, one thread (run under taskset -c 1).

    python bench/results/cpu-2core/2026-11-26-prompt-attention/kernel_ab.py
"""

import time

import torch
import torch.nn.functional as F

from pipeserve.engine.backend import native

torch.set_num_threads(1)
assert native.available()
length, heads, kv_heads, dim = 512, 12, 4, 64
qkv = torch.randn(length, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
q = qkv[:, :heads * dim].view(length, heads, dim)
k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(length, kv_heads, dim)
v = qkv[:, (heads + kv_heads) * dim:].view(length, kv_heads, dim)
out = torch.empty(length, heads, dim, dtype=torch.bfloat16)
assert native.supports_prompt_attention(q, k, v)


def ours() -> None:
    native.prompt_attention(q, k, v, dim ** -0.5, out)


def sdpa() -> None:
    F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), is_causal=True,
                                   enable_gqa=True)


def ms(fn, n: int = 50) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


for rnd in range(5):
    a, b = (ms(ours), ms(sdpa)) if rnd % 2 == 0 else tuple(reversed((ms(sdpa), ms(ours))))
    print(f"prompt kernel {a:.3f} ms, SDPA {b:.3f} ms, SDPA / kernel {b / a:.2f}", flush=True)
