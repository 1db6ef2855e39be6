"""`pipeserve bench cpu-ops`: the cpu backend's own kernels against the torch ops they replace, one
thread, alternated, medians:

- linear: the native packed product (pipeserve/engine/backend/native.py, used by
  pipeserve/engine/backend/cpu_linear.py; the weight packed once beforehand) vs F.linear (MKL), by row
  count, on the ~18M Llama's weight shapes by default, each over copies of the weight totalling 64
  MB (a model's weights are not in the core's caches when its step reaches them);
- decode attention: the native kernel (pipeserve/engine/backend/native.py) vs the torch path (pages
  gathered, one masked SDPA call), on stories260K's, the ~18M and ~76M Llamas' and an 8B's head
  shapes, fp32 and bf16 caches.

    pipeserve bench cpu-ops --json ops.json
    pipeserve bench cpu-ops --ops attention
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pipeserve.bench.report import machine_info, print_table, write_json
from pipeserve.engine.host_memory import keep_freed_memory

# (rows, KV heads, query heads per KV head, head_dim, keys, cache dtype) of decode attention calls.
ATTENTION = ((1, 4, 2, 64, 150, torch.float32), (32, 4, 2, 64, 140, torch.float32),
             (64, 4, 2, 8, 165, torch.float32), (8, 8, 4, 128, 1000, torch.float32),
             (64, 4, 3, 64, 256, torch.float32), (64, 4, 3, 64, 256, torch.bfloat16),
             (8, 8, 4, 128, 1000, torch.bfloat16))
OPS = ("linear", "attention")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--linear-shapes", default="2816x512,512x1408,1024x512,512x512",
                        help="comma-separated NxK weight shapes")
    parser.add_argument("--rows", default="1,3,4,5,8,16,32,64,128,256", help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=5, help="alternated rounds (medians reported)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")


def _time(fn: Callable[[], Any], min_seconds: float = 0.02) -> float:
    """Microseconds per call: enough calls for min_seconds, after a warm-up."""
    for _ in range(3):
        fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        fn()
        calls += 1
    return elapsed / calls * 1e6


def _alternate(a: Callable[[], Any], b: Callable[[], Any], repeats: int) -> tuple[float, float]:
    ta: list[float] = []
    tb: list[float] = []
    for rep in range(repeats):
        for fn, out in ((a, ta), (b, tb)) if rep % 2 == 0 else ((b, tb), (a, ta)):
            out.append(_time(fn))
    return statistics.median(ta), statistics.median(tb)


def linear_rows(shapes: list[tuple[int, int]], rows: list[int], repeats: int) -> list[dict[str, Any]]:
    from pipeserve.engine.backend import native

    out = []
    for n, k in shapes:
        weights = [torch.randn(n, k) for _ in range(max(1, (64 << 20) // (n * k * 4)))]
        packed = native.pack_weights(weights)
        for m in rows:
            x = torch.randn(m, k)

            def mkl(x: torch.Tensor = x, ws: list[torch.Tensor] = weights) -> None:
                for w in ws:
                    F.linear(x, w)

            def native_packed(x: torch.Tensor = x, ws: list[torch.Tensor] = packed, n: int = n) -> None:
                for w in ws:
                    native.packed_linear(x, w, None, n)

            t_mkl, t_native = (t / len(weights) for t in _alternate(mkl, native_packed, repeats))
            out.append({"n": n, "k": k, "rows": m, "f_linear_us": t_mkl, "native_us": t_native,
                        "native_over_f_linear": t_native / t_mkl,
                        "native_GBps": n * k * 4 / t_native / 1e3, "f_linear_GBps": n * k * 4 / t_mkl / 1e3})
    return out


def decode_attention(repeats: int) -> list[dict[str, Any]]:
    from pipeserve.engine.backend import cpu, native

    out = []
    for batch, hkv, group, dim, keys, dtype in ATTENTION:
        page = 16
        pages = batch * -(-keys // page)
        k_cache, v_cache = (torch.randn(pages + 1, page, hkv, dim).to(dtype) for _ in range(2))
        tables = torch.randperm(pages, dtype=torch.int32).view(batch, -1)
        lens = torch.full((batch,), keys, dtype=torch.int32)
        q = torch.randn(batch, hkv * group, dim).to(dtype)
        args = (q, k_cache, v_cache, tables, lens, dim**-0.5)

        def torch_path(args: tuple[Any, ...] = args) -> torch.Tensor:
            return cpu.torch_decode_attention(*args)

        def kernel(args: tuple[Any, ...] = args) -> torch.Tensor:
            q, k_cache, v_cache, tables, lens, scale = args
            return native.decode_attention(q, k_cache, v_cache, tables, lens, scale, None)

        fast, slow = _alternate(kernel, torch_path, repeats)
        out.append({"rows": batch, "kv_heads": hkv, "group": group, "head_dim": dim, "keys": keys,
                    "dtype": str(dtype).removeprefix("torch."), "native_us": fast, "torch_us": slow,
                    "speedup": slow / fast})
    return out


def main(args: argparse.Namespace) -> int:
    from pipeserve.engine.backend import native

    if not native.available():
        raise SystemExit("bench cpu-ops: the native kernels are unavailable (no C++ compiler)")
    torch.set_num_threads(1)
    keep_freed_memory()  # as an engine on the CPU runs: outputs reuse freed heap, not fresh pages
    shapes = [(int(a), int(b)) for a, b in (s.split("x") for s in args.linear_shapes.split(","))]
    rows = [int(r) for r in args.rows.split(",")]
    ops = args.ops.split(",")
    if unknown := set(ops) - set(OPS):
        raise SystemExit(f"bench cpu-ops: --ops takes {', '.join(OPS)}, not {', '.join(sorted(unknown))}")
    results: dict[str, Any] = {"loadavg_before": open("/proc/loadavg").read().split()[:3]}
    with torch.inference_mode():
        results["linear"] = linear_rows(shapes, rows, args.repeats) if "linear" in ops else []
        results["decode_attention"] = decode_attention(args.repeats) if "attention" in ops else []
    results |= {"machine": machine_info(), "loadavg_after": open("/proc/loadavg").read().split()[:3],
                "repeats": args.repeats}
    if results["linear"]:
        print_table("linear: native packed product / F.linear (MKL) time, by rows (1 thread, cold weights)",
                    ["weight", *map(str, rows)],
                    [[f"{n}x{k}", *(r["native_over_f_linear"] for r in results["linear"]
                                    if (r["n"], r["k"]) == (n, k))] for n, k in shapes])
    if results["decode_attention"]:
        print_table("decode attention, µs per call (1 thread)",
                    ["rows", "kv heads x group", "head_dim", "keys", "cache", "native", "torch", "speedup"],
                    [[r["rows"], f"{r['kv_heads']}x{r['group']}", r["head_dim"], r["keys"], r["dtype"],
                      r["native_us"], r["torch_us"], r["speedup"]] for r in results["decode_attention"]])
    if args.json:
        write_json(args.json, results)
    return 0
