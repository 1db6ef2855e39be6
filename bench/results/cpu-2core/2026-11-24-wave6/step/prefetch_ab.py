"""A/B of two packed_gemm.cpp sources on the ~18M Llama's 24 one-row products (one decode step's
linear layers at batch 1), one thread, the two libraries alternated over 40 rounds; medians.

    git show 4e1387b:services/engine/backend/csrc/packed_gemm.cpp > /tmp/old.cpp
    python bench/results/cpu-2core/2026-11-24-wave6/step/prefetch_ab.py /tmp/old.cpp \
        services/engine/backend/csrc/packed_gemm.cpp
"""

import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from services.engine.backend.native import FLAGS

SHAPES = [(1024, 512), (512, 512), (2816, 512), (512, 1408)] * 6  # qkv, o, gate_up, down per layer


def build(source: str, out: Path) -> ctypes.CDLL:
    subprocess.run(["g++", *FLAGS, "-o", str(out), source], check=True)
    lib = ctypes.CDLL(str(out))
    lib.pipeserve_packed_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_int]
    lib.pipeserve_pack_weight.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"A": sys.argv[1], "B": sys.argv[2]}
        libs = {name: build(src, Path(tmp) / f"{name}.so") for name, src in sources.items()}
        rng = np.random.default_rng(0)
        x = rng.standard_normal(2048, dtype=np.float32)
        keep, calls = [], []
        for n, k in SHAPES:  # separate allocations, as a model's weights are
            w = rng.standard_normal((n, k), dtype=np.float32)
            packed = np.empty(-(-n // 16) * 16 * k, np.float32)
            libs["A"].pipeserve_pack_weight(w.ctypes.data, n, k, packed.ctypes.data)
            y = np.empty(n, np.float32)
            keep += [packed, y]
            calls.append((x.ctypes.data, k, packed.ctypes.data, None, y.ctypes.data, 1, n, k, 1))
        ms: dict[str, list[float]] = {name: [] for name in libs}
        for r in range(40):
            for name in ("A", "B") if r % 2 else ("B", "A"):
                f = libs[name].pipeserve_packed_linear
                for c in calls:
                    f(*c)
                start = time.perf_counter()
                for _ in range(10):
                    for c in calls:
                        f(*c)
                ms[name].append((time.perf_counter() - start) / 10 * 1e3)
        a, b = statistics.median(ms["A"]), statistics.median(ms["B"])
        print(f"A {sys.argv[1]}: {a:.3f} ms/step   B {sys.argv[2]}: {b:.3f} ms/step   B/A {b / a:.3f}")


if __name__ == "__main__":
    main()
