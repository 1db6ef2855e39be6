import ctypes, statistics, sys, time, torch
torch.set_num_threads(1)
from pipeserve.engine.backend import native
native.available()
n, k, m = int(sys.argv[1]), int(sys.argv[2]), 64
weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range((64 << 20) // (n * k * 2))]
packed = native.pack_weights(weights)
x = torch.randn(m, k); out = torch.empty(m, n)
lib = native._lib
f = lib.pipeserve_packed_linear_bf16
fnptr = ctypes.cast(f, ctypes.c_void_p)
loop = ctypes.CDLL("./libloop.so").loop
ptrs = (ctypes.c_void_p * len(packed))(*[p.data_ptr() for p in packed])
def cloop():
    loop(fnptr, ctypes.c_void_p(x.data_ptr()), ptrs, ctypes.c_int64(len(packed)), ctypes.c_void_p(out.data_ptr()),
         ctypes.c_int64(m), ctypes.c_int64(n), ctypes.c_int64(k), ctypes.c_int(2))
def pyloop():
    for _ in range(2):
        for p in packed:
            f(x.data_ptr(), k, p.data_ptr(), None, out.data_ptr(), m, n, k, 1)
res = {"c loop": [], "py loop": []}
for _ in range(15):
    for name, fn in (("c loop", cloop), ("py loop", pyloop)):
        t = time.perf_counter(); fn(); res[name].append((time.perf_counter() - t) / (2 * len(packed)))
print(n, k, {name: round(2 * m * n * k / statistics.median(v) / 1e9) for name, v in res.items()})
