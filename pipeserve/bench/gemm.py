"""`pipeserve bench gemm`: the CPU's two products by row count, on the model shapes: the native
packed product (backend/native.py) against oneDNN's GEMM with a weight reordered once
(backend/cpu_gemm.py), fp32 and bf16, one thread, alternated, medians; beside them the rate
torch.matmul reaches on a large square product, the ceiling the many-row products are held to.
The packed product writes one output tensor reused across calls, as the native decode step's
products write its buffers; the GEMM returns a new tensor, as its torch op does.

    pipeserve bench gemm --json gemm.json --write-table

--write-table records each shape's crossover (the fewest rows from which the GEMM wins at every
larger count measured, by a margin) for this host's CPU class in backend/cpu_gemm_table.json, the
table the serving layers read (other CPU classes' entries, and the dtypes not measured, are kept;
each dtype's entries name the command that measured them). --from-json PATH recomputes
them from a saved run, measuring nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pipeserve.bench.report import machine_info, print_table, write_json
from pipeserve.engine.host_memory import keep_freed_memory

# The [N, K] weights of the ~76M Llama (hidden 768, 12 heads / 4 KV heads of 64, intermediate 2048:
# qkv, o, gate_up, down) and of the ~18M one (hidden 512, 8 / 4 heads of 64, intermediate 1408).
SHAPES = "1280x768,768x768,4096x768,768x2048,1024x512,512x512,2816x512,512x1408"
ROWS = "1,2,4,8,16,32,48,64,96,128,192,256,512,1024,2048"  # up to the default step budget (2048 tokens)
SQUARE = 2048  # torch.matmul's large-shape rate: [SQUARE, SQUARE] x [SQUARE, SQUARE]
# Without oneDNN's bf16 GEMM (an AVX2 CPU) torch.matmul runs bf16 in a plain loop at well under a
# GFLOP/s: its rate is read on a smaller square, which takes seconds instead of minutes.
SQUARE_PLAIN = 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated NxK weight shapes")
    parser.add_argument("--rows", default=ROWS, help="comma-separated row counts")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="alternated rounds (medians reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the engine's one thread)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--write-table", action="store_true",
                        help="record the crossovers in pipeserve/engine/backend/cpu_gemm_table.json")
    parser.add_argument("--with-matmul", action="store_true",
                        help="time torch.matmul's large product in every round too (the ceiling per cell)")
    parser.add_argument("--from-json", metavar="PATH",
                        help="measure nothing: the crossovers (and --write-table) from a saved --json run")


def _time(fn: Callable[[], Any], min_seconds: float = 0.03) -> float:
    """Seconds per call: enough calls for min_seconds, after a warm-up."""
    for _ in range(2):
        fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        fn()
        calls += 1
    return elapsed / calls


def _alternate(fns: list[Callable[[], Any]], repeats: int) -> list[float]:
    times: list[list[float]] = [[] for _ in fns]
    for rep in range(repeats):
        order = list(range(len(fns))) if rep % 2 == 0 else list(reversed(range(len(fns))))
        for i in order:
            times[i].append(_time(fns[i]))
    return [statistics.median(t) for t in times]


def square(dtype: torch.dtype) -> int:
    from pipeserve.engine.backend import cpu_gemm

    return SQUARE if cpu_gemm.available(dtype) else SQUARE_PLAIN


def matmul_rate(dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of torch.matmul on a large square product."""
    side = square(dtype)
    a, b = torch.randn(side, side, dtype=dtype), torch.randn(side, side, dtype=dtype)
    (t,) = _alternate([lambda: torch.matmul(a, b)], repeats)
    return 2 * side**3 / t / 1e9


def measure(dtype: torch.dtype, n: int, k: int, rows: list[int], repeats: int,
            with_matmul: bool = False) -> dict[str, Any]:
    from pipeserve.engine.backend import cpu_gemm, native

    # Copies totalling 64 MB: a model's weights are not in the core's caches when its step reaches them.
    weights = [torch.randn(n, k).to(dtype) for _ in range(max(1, (64 << 20) // (n * k * dtype.itemsize)))]
    packed = native.pack_weights(weights)
    packed_us: list[float] = []
    gemm_us: list[float | None] = []  # None: no oneDNN GEMM for this dtype on this CPU
    ceiling: list[float] = []
    side = square(dtype)
    a, b = torch.randn(side, side, dtype=dtype), torch.randn(side, side, dtype=dtype)
    has_gemm = cpu_gemm.available(dtype)
    for m in rows:
        x = torch.randn(m, k)
        xd = x.to(dtype)
        reordered = [cpu_gemm.reorder(w, m) for w in weights] if has_gemm else []

        out = torch.empty(m, n)

        def packed_product(x: torch.Tensor = x, out: torch.Tensor = out) -> None:
            for p in packed:
                native.packed_linear(x, p, None, n, out=out)

        def gemm(x: torch.Tensor = xd, ws: list[torch.Tensor] = reordered) -> None:
            for w in ws:
                cpu_gemm.linear(x, w, None)

        fns: list[Callable[[], Any]] = [packed_product, *([gemm] if has_gemm else [])]
        if with_matmul:
            fns.append(lambda: torch.matmul(a, b))
        times = _alternate(fns, repeats)
        packed_us.append(times[0] / len(weights) * 1e6)
        gemm_us.append(times[1] / len(weights) * 1e6 if has_gemm else None)
        if with_matmul:  # the ceiling in the same rounds: a shared machine's speed moves between runs
            ceiling.append(2 * side**3 / times[-1] / 1e9)
    name = str(dtype).removeprefix("torch.")
    flops = [2 * m * n * k for m in rows]
    return {"dtype": name, "n": n, "k": k, "rows": rows, "packed_us": packed_us, "gemm_us": gemm_us,
            "packed_GFLOPs": [f / t / 1e3 for f, t in zip(flops, packed_us, strict=True)],
            "gemm_GFLOPs": [None if t is None else f / t / 1e3 for f, t in zip(flops, gemm_us, strict=True)],
            "gemm_from": crossover(rows, packed_us, gemm_us),
            **({"matmul_GFLOPs": ceiling} if with_matmul else {})}


def crossover(rows: list[int], packed_us: list[float], gemm_us: list[float | None]) -> int | None:
    """cpu_gemm.crossover, or None where the GEMM was not measured (no oneDNN GEMM for the dtype)."""
    from pipeserve.engine.backend import cpu_gemm

    if any(g is None for g in gemm_us):
        return None
    return cpu_gemm.crossover(rows, packed_us, [g for g in gemm_us if g is not None])


def write_table(entries: list[dict[str, Any]], machine: dict[str, Any], command: str, cpu: str) -> str:
    from pipeserve.engine.backend import cpu_gemm

    data: dict[str, Any] = json.loads(cpu_gemm.TABLE.read_text()) if cpu_gemm.TABLE.is_file() else {}
    measured = {e["dtype"] for e in entries}
    previous = data.get(cpu, {})
    kept = [e for e in previous.get("entries", ()) if e["dtype"] not in measured]
    commands = {**previous.get("commands", {}), **{dtype: command for dtype in measured}}
    new = [{"dtype": e["dtype"], "n": e["n"], "k": e["k"], "gemm_from": e["gemm_from"]} for e in entries]
    data[cpu] = {"commands": commands, "machine": machine.get("cpu", ""), "threads": torch.get_num_threads(),
                 "entries": kept + new}
    cpu_gemm.TABLE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return str(cpu_gemm.TABLE)


def main(args: argparse.Namespace) -> int:
    from pipeserve.engine.backend import cpu_gemm, native

    if not native.available() or not cpu_gemm.available():
        raise SystemExit("bench gemm: needs the native kernels (a C++ compiler) and torch with oneDNN")
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as an engine on the CPU runs: outputs reuse freed heap, not fresh pages
    if args.from_json:
        with open(args.from_json) as f:
            results: dict[str, Any] = json.load(f)
        for e in results["shapes"]:
            e["gemm_from"] = crossover(e["rows"], e["packed_us"], e["gemm_us"])
        rows = results["shapes"][0]["rows"]
        machine = results["machine"]
        command = results["command"]
    else:
        shapes = [(int(a), int(b)) for a, b in (s.split("x") for s in args.shapes.split(","))]
        rows = [int(r) for r in args.rows.split(",")]
        dtypes = [cpu_gemm.DTYPES[d] for d in args.dtypes.split(",")]
        for d in dtypes:
            if not cpu_gemm.available(d):
                print(f"bench gemm: oneDNN has no {d} GEMM on this CPU (it needs AVX-512 BW/VL/DQ or "
                      f"AVX-NE-CONVERT): the packed product alone, which serves it at every row count here; "
                      f"torch.matmul's rate read on {SQUARE_PLAIN}^3")
        command = "pipeserve bench gemm " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in (("shapes", args.shapes), ("rows", args.rows),
                                                        ("dtypes", args.dtypes), ("repeats", args.repeats),
                                                        ("threads", args.threads)))
        command += " --with-matmul" * args.with_matmul + " --write-table" * args.write_table
        command += f" --json {args.json}" if args.json else ""
        results = {"loadavg_before": open("/proc/loadavg").read().split()[:3],
                   "cpu_class": cpu_gemm.cpu_class(), "isa": native.isa(), "command": command}
        with torch.inference_mode():
            results["matmul_GFLOPs"] = {str(d).removeprefix("torch."): matmul_rate(d, args.repeats)
                                        for d in dtypes}
            results["shapes"] = [measure(d, n, k, rows, args.repeats, args.with_matmul)
                                 for d in dtypes for n, k in shapes]
        machine = machine_info()
        results |= {"machine": machine, "loadavg_after": open("/proc/loadavg").read().split()[:3],
                    "repeats": args.repeats, "threads": args.threads}
    for entry in results["shapes"]:
        ceiling = entry.get("matmul_GFLOPs") or [results["matmul_GFLOPs"][entry["dtype"]]] * len(rows)
        best = [max(p, g or 0.0) for p, g in zip(entry["packed_GFLOPs"], entry["gemm_GFLOPs"], strict=True)]
        entry["best_over_matmul"] = [b / c for b, c in zip(best, ceiling, strict=True)]
    for name in results["matmul_GFLOPs"]:
        print_table(f"{name}: packed / oneDNN GFLOP/s by rows ({results['threads']} thread(s); torch.matmul: "
                    f"{results['matmul_GFLOPs'][name]:.1f} GFLOP/s)",
                    ["weight", "from", *map(str, rows)],
                    [[f"{e['n']}x{e['k']}", str(e["gemm_from"]),
                      *(f"{p:.0f}/{'-' if g is None else f'{g:.0f}'}"
                        for p, g in zip(e["packed_GFLOPs"], e["gemm_GFLOPs"], strict=True))]
                     for e in results["shapes"] if e["dtype"] == name])
    print_table("the faster product's rate / torch.matmul's in the same rounds (--with-matmul) or run",
                ["dtype", "weight", *map(str, rows)],
                [[e["dtype"], f"{e['n']}x{e['k']}", *(f"{r:.2f}" for r in e["best_over_matmul"])]
                 for e in results["shapes"]])
    if args.write_table:
        print("table written:", write_table(results["shapes"], machine, command, results["cpu_class"]))
    if args.json:
        write_json(args.json, results)
    return 0
