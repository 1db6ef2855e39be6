"""gpu-check's first sections: what the host is, and what it can do at best (the ceilings the speed
rows are held to)."""

from __future__ import annotations

import platform
import statistics
import subprocess
from collections.abc import Callable

import torch

from .runner import Context


def environment(ctx: Context) -> None:
    """GPU name, SM count, memory, driver, CUDA, torch, triton, Python."""
    import triton

    device = torch.device(ctx.device)
    info: dict[str, object] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": props.name,
            "sm": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "memory_gb": round(props.total_memory / 1e9, 1),
            "driver": driver_version(),
        }
    else:
        info |= {"gpu": f"none ({device.type})", "sm_count": 0, "memory_gb": 0.0, "driver": None}
    ctx.emit("environment", info)


def driver_version() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), None where it cannot be asked."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def timed(fn: Callable[[], object], device: torch.device, repeats: int, inner: int = 8) -> float:
    """Median seconds of one call of fn over `repeats` timings, after a warm-up call (which compiles
    and autotunes). On a GPU each timing is `inner` calls replayed from one CUDA graph between two
    events: the device's time alone, as in the engine's captured steps. Timing single launches would
    add the host's launch of each kernel (tens of microseconds for a Triton kernel launched from
    Python, more than a small kernel runs). What a graph cannot capture (a host readback) is timed as
    `inner` calls launched back to back between the events instead."""
    fn()
    if device.type != "cuda":
        import time

        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    replay = _captured(fn, inner)
    if replay is None:

        def replay() -> None:
            for _ in range(inner):
                fn()

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def _captured(fn: Callable[[], object], inner: int) -> Callable[[], object] | None:
    """A CUDA graph of `inner` calls of fn (its replay), None when fn cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm on a side stream first, as capture needs (allocator, library handles)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    except RuntimeError:  # a host sync inside fn: not capturable
        torch.cuda.synchronize()
        return None
    return graph.replay


def copy_gbps(device: torch.device, nbytes: int, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth: bytes read + written per second, in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, repeats) / 1e9


def matmul_tflops(device: torch.device, n: int, dtype: torch.dtype = torch.bfloat16,
                  repeats: int = 10) -> float:
    """A large square matmul's TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, device, repeats) / 1e12


def ceilings(ctx: Context) -> None:
    """The measured copy bandwidth (1 GiB buffers on a GPU) and bf16 matmul rate (8192^3)."""
    device = torch.device(ctx.device)
    big = device.type == "cuda"
    ctx.emit("ceilings", {
        "copy_gbps": copy_gbps(device, 2**30 if big else 2**22),
        "bf16_tflops": matmul_tflops(device, 8192 if big else 256),
    })
