"""This machine's own roofline: measure its memory-copy bandwidth and matmul rate in the run that
benchmarks it, and cost the engine's model on those figures (a CPU is treated as a "GPU" with them).

Datasheet peaks say what a part could do; the measured figures say what this one does today, under
whatever else it is running, so a benchmark's "% of roofline" compares like with like.

    rates = measure(device, torch.float32)
    cost = floor_cost(ModelShape.from_path(model_dir), rates, torch.float32)
    cost.decode(batch=8, context=128).t   # seconds: the floor of one decode step on this machine
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from pipeserve.capacity.gpus import GPU
from pipeserve.capacity.roofline import CostModel, ModelShape, cost_model


@dataclass(frozen=True)
class MachineRates:
    """Best of several timed repeats: the floor uses the fastest this machine has shown it can go."""

    device: str  # "cpu" or the CUDA device name
    dtype: str  # the dtype the matmul rate was measured in (the engine's)
    copy_bandwidth: float  # bytes/s, bytes read + bytes written by one large tensor copy
    matmul_flops: float  # FLOP/s of a square matmul in `dtype`
    memory: float  # bytes of device memory (RAM for a CPU)
    copy_bytes: int  # size of the copied buffer
    matmul_n: int  # the matmul was n x n x n
    threads: int  # torch intra-op threads (CPU)

    def as_gpu(self) -> GPU:
        """The roofline's GPU record for this machine: every GEMM format runs at the measured rate."""
        name = f"{self.device} (measured)"
        return GPU(name, self.copy_bandwidth, self.matmul_flops, None, None, self.memory)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _best_time(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: allocation, kernel selection, page faults
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _device_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _copy_time(device: torch.device, nbytes: int, sync: Callable[[], None], repeats: int) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return _best_time(lambda: dst.copy_(src), sync, repeats)


def _matmul_time(
    device: torch.device, dtype: torch.dtype, n: int, sync: Callable[[], None], repeats: int
) -> float:
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device).to(dtype)
    b = torch.randn(n, n, generator=gen, device=device).to(dtype)
    out = torch.empty_like(a)
    return _best_time(lambda: torch.mm(a, b, out=out), sync, repeats)


def measure(
    device: torch.device | str,
    dtype: torch.dtype,
    copy_bytes: int | None = None,
    matmul_n: int | None = None,
    repeats: int = 5,
) -> MachineRates:
    """Time a copy of a buffer far larger than the caches, and an n x n x n matmul in `dtype`.
    Defaults: 1 GiB and n = 8192 on CUDA, 256 MiB and n = 1024 on a CPU (a few seconds at most)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (2**30 if cuda else 2**28)
    matmul_n = matmul_n or (8192 if cuda else 1024)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    t_copy = _copy_time(device, copy_bytes, sync, repeats)
    t_mm = _matmul_time(device, dtype, matmul_n, sync, repeats)
    if cuda:  # hand the buffers back: the engine sizes its KV pool from free memory
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return MachineRates(
        device=name,
        dtype=str(dtype).removeprefix("torch."),
        copy_bandwidth=2 * copy_bytes / t_copy,
        matmul_flops=2 * matmul_n**3 / t_mm,
        memory=_device_memory(device),
        copy_bytes=copy_bytes,
        matmul_n=matmul_n,
        threads=torch.get_num_threads(),
    )


def floor_cost(shape: ModelShape, rates: MachineRates, dtype: torch.dtype) -> CostModel:
    """The roofline cost model of `shape` run unquantized in `dtype` on this machine. The roofline
    counts 2-byte weights and KV (bf16); a run in another dtype moves itemsize / 2 times every byte."""
    cost = cost_model(shape, rates.as_gpu(), "bf16", "bf16")
    scale = dtype.itemsize / 2
    return replace(
        cost,
        weight_bytes=cost.weight_bytes * scale,
        weight_bytes_read=cost.weight_bytes_read * scale,
        expert_bytes=cost.expert_bytes * scale,
        kv_bytes_per_token=cost.kv_bytes_per_token * scale,
    )
