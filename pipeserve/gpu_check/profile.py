"""gpu-check's profile section: where a batch-1 decode step's time goes, for the targets the speed rows
miss. torch.profiler over steady decode steps of the Llama-3-8B and Llama-3.2-1B shapes (random bf16
weights): eager (each kernel launched by the host, as the model's ops run) and with CUDA graphs (the
step replayed), one row of device time and wall time per step each, then the kernels that take the
most device time, each with its share. Wall time well above device time is time the GPU waits for the
host (launches, the step's Python); device time above the weights' floor is the kernels'.

Every function takes its device, so the tests run the same code on the CPU (the CPU activity and
torch's CPU ops instead of kernels)."""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.profiler import DeviceType

from .models import write_shape_config
from .report import SpeedRow
from .runner import Context, run_parts

TOP = 12  # kernels listed per profile
CASES = (("llama8b", False), ("llama8b", True), ("llama1b", True))  # (shape, CUDA graphs)


@dataclass(frozen=True)
class Kernel:
    name: str
    us_per_step: float
    calls_per_step: float


@dataclass(frozen=True)
class StepProfile:
    device_ms: float  # kernel time per step (on the CPU: the ops' own time)
    wall_ms: float
    kernels: list[Kernel]  # by time, longest first


def profile_steps(eng: Any, warm: int = 4, steps: int = 8, prompt_len: int = 32) -> StepProfile:
    """Profile `steps` steady batch-1 decode steps of `eng` (one request, its prompt already in)."""
    from .speed import drain, steady_decode, step_seconds

    cuda = eng.device.type == "cuda"
    sync = steady_decode(eng, 1, prompt_len, warm, steps)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        wall = step_seconds(eng, steps, sync)
    drain(eng)
    kernels = []
    for event in prof.key_averages():
        if cuda and event.device_type != DeviceType.CUDA:
            continue
        self_us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if self_us > 0:
            kernels.append(Kernel(event.key, self_us / steps, event.count / steps))
    kernels.sort(key=lambda k: -k.us_per_step)
    return StepProfile(sum(k.us_per_step for k in kernels) / 1e3, wall * 1e3, kernels)


def profile_rows(ctx: Context, tag: str, profile: StepProfile, top: int = TOP) -> None:
    busy = 100.0 * profile.device_ms / profile.wall_ms if profile.wall_ms else 0.0
    ctx.row(SpeedRow(f"profile_{tag}", round(profile.device_ms, 3), "ms/step",
                     detail=f"device time per step; wall {profile.wall_ms:.3f} ms/step ({busy:.0f}% busy)"))
    for i, k in enumerate(profile.kernels[:top]):
        share = 100.0 * k.us_per_step / (profile.device_ms * 1e3) if profile.device_ms else 0.0
        ctx.row(SpeedRow(f"profile_{tag}_{i + 1:02d}", round(k.us_per_step, 2), "us/step",
                         detail=f"{share:.1f}% {k.calls_per_step:g}x/step {k.name[:160]}"))


def shape_profile(ctx: Context, tmp: str, shape: str, graphs: bool) -> None:
    from .speed import engine

    eng = engine(write_shape_config(f"{tmp}/{shape}", shape), graphs, 1, kv_cache_gb=2.0)
    try:
        profile_rows(ctx, f"{shape}_b1_{'graphs' if graphs else 'eager'}", profile_steps(eng))
    finally:
        del eng
        gc.collect()
        torch.cuda.empty_cache()


def run(ctx: Context) -> None:
    if ctx.device != "cuda":
        raise RuntimeError("the profile rows need CUDA")
    with tempfile.TemporaryDirectory(prefix="gpu-check-profile-") as tmp:
        parts: dict[str, Callable[[], None]] = {
            f"{shape} {'graphs' if graphs else 'eager'}": partial(shape_profile, ctx, tmp, shape, graphs)
            for shape, graphs in CASES}
        failed = run_parts(parts)
    if failed:
        raise RuntimeError("; ".join(failed))
