"""Two builds of the native library's fp32 packed product, alternated in one process over the ~76M
model's four weight shapes (cold copies), one thread (run under taskset -c 1); README.md says how the
builds were made.

    python ab_shape.py base,8x3      # loads /tmp/pf/k_base.so and /tmp/pf/k_8x3.so
"""

import ctypes
import statistics
import sys
import time

import torch

from pipeserve.engine.backend import native

torch.set_num_threads(1)
assert native.available()
libs = {name: native._declare(ctypes.CDLL(f"/tmp/pf/k_{name}.so")) for name in sys.argv[1].split(",")}
square = torch.randn(2048, 2048)


def seconds(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def products(x: torch.Tensor, packed: list[torch.Tensor], n: int) -> None:
    for p in packed:
        native.packed_linear(x, p, None, n)


for n, k in [(1280, 768), (768, 768), (4096, 768), (768, 2048)]:
    copies = max(1, (64 << 20) // (n * k * 4))
    packed = native.pack_weights([torch.randn(n, k) for _ in range(copies)])
    for rows in (64, 128):
        x = torch.randn(rows, k)
        times: dict[str, list[float]] = {name: [] for name in libs}
        matmul: list[float] = []
        for rnd in range(5):
            order = list(libs.items())
            for name, lib in order if rnd % 2 == 0 else order[::-1]:
                native._lib = lib
                times[name].append(seconds(products, x, packed, n) / copies)
            matmul.append(2 * 2048**3 / seconds(torch.matmul, square, square) / 1e9)
        flops, ceiling = 2 * rows * n * k, statistics.median(matmul)
        rates = {name: flops / statistics.median(t) / 1e9 for name, t in times.items()}
        shown = " ".join(f"{name}: {r:.0f} GF/s ({r / ceiling:.2f})" for name, r in rates.items())
        print(f"{n}x{k} {rows}: {shown} matmul {ceiling:.0f}", flush=True)
