"""cl.py N K: the bf16 product at 64 rows over copies of an N x K weight totalling 64 MB, called from
a C loop inside this process (libloop.so, built from loop.c) and from a Python loop of ctypes calls,
alternated; GFLOP/s of each (medians of 15 rounds)."""

import ctypes
import statistics
import sys
import time

import torch

from pipeserve.engine.backend import native

torch.set_num_threads(1)
native.available()
n, k, m = int(sys.argv[1]), int(sys.argv[2]), 64
weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range((64 << 20) // (n * k * 2))]
packed = native.pack_weights(weights)
x, out = torch.randn(m, k), torch.empty(m, n)
assert native._lib is not None
product = native._lib.pipeserve_packed_linear_bf16
address = ctypes.cast(product, ctypes.c_void_p)
loop = ctypes.CDLL("./libloop.so").loop
pointers = (ctypes.c_void_p * len(packed))(*[p.data_ptr() for p in packed])


def c_loop() -> None:
    loop(address, ctypes.c_void_p(x.data_ptr()), pointers, ctypes.c_int64(len(packed)),
         ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(m), ctypes.c_int64(n), ctypes.c_int64(k),
         ctypes.c_int(2))


def py_loop() -> None:
    for _ in range(2):
        for p in packed:
            product(x.data_ptr(), k, p.data_ptr(), None, out.data_ptr(), m, n, k, 1)


times: dict[str, list[float]] = {"c loop": [], "py loop": []}
for _ in range(15):
    for name, fn in (("c loop", c_loop), ("py loop", py_loop)):
        start = time.perf_counter()
        fn()
        times[name].append((time.perf_counter() - start) / (2 * len(packed)))
print(n, k, {name: round(2 * m * n * k / statistics.median(v) / 1e9) for name, v in times.items()})
