"""The 49 one-row products of a ~76M Llama decode step through each given build of the native
library, alternated: PYTHONPATH=<checkout> python ab.py [--bf16] LIB.so ... (see ../README.md)."""

import ctypes
import sys
import time

import torch

from pipeserve.engine.backend import native

torch.set_num_threads(1)
assert native.available()
shapes = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12 + [(512, 768)]
bf16 = sys.argv[1] == "--bf16"
paths = sys.argv[2:] if bf16 else sys.argv[1:]
dtype = torch.bfloat16 if bf16 else torch.float32
weights = native.pack_weights([torch.randn(n, k).to(dtype) for n, k in shapes])
xs = {k: torch.randn(1, k) for _, k in shapes}
outs = {n: torch.empty(1, n) for n, _ in shapes}
total = sum(w.numel() * w.element_size() for w in weights)
ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
libs = {}
for path in paths:
    lib = ctypes.CDLL(path)
    fn = lib.pipeserve_packed_linear_bf16 if bf16 else lib.pipeserve_packed_linear
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i32]
    libs[path.split("/")[-1]] = fn


def step(fn) -> None:
    for (n, k), w in zip(shapes, weights, strict=True):
        fn(xs[k].data_ptr(), k, w.data_ptr(), None, outs[n].data_ptr(), 1, n, k, 1)


for fn in libs.values():  # warm: page faults, first calls
    step(fn)
times: dict[str, list[float]] = {name: [] for name in libs}
order = list(libs.items())
for r in range(25):
    for name, fn in order[r % len(order):] + order[: r % len(order)]:
        start = time.perf_counter()
        step(fn)
        times[name].append(time.perf_counter() - start)
for name, ts in times.items():
    ts.sort()
    median = ts[len(ts) // 2]
    rate = total / median / 1e9
    print(f"{name:14s} median {median * 1e3:6.2f} ms  min {ts[0] * 1e3:6.2f}  {rate:5.1f} GB/s")
