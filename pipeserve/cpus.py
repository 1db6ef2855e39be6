"""How the pipeline's processes share a CPU-only host's cores.

On a CPU device the engine computes on the host's cores, and every other process (gateway, tokenizers,
detokenizer) wakes up for each request and step. Sharing cores, they evict the engine's caches and
preempt its threads, so each request's first step runs cold (docs/engine.md has the measured cost).
So the launcher gives the engine its own cores and the rest of the pipeline the remaining ones. On a
GPU host the engine's CPU work is light and nothing is pinned.
Children read their set from PIPESERVE_CPUS (applied first thing in the fresh interpreter, before it
starts any thread, so every thread inherits it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pipeserve.config import EngineConfig

ENV = "PIPESERVE_CPUS"


@dataclass(frozen=True)
class CpuSplit:
    engine: tuple[int, ...]  # the engine's cores (its torch threads: one per core)
    others: tuple[int, ...]  # gateway, tokenizers, detokenizer (and a benchmark's client)


def engine_core_count(config: EngineConfig, available: int) -> int:
    """How many of `available` cores the engine computes on: cpu_threads, else all but one (the rest
    of the pipeline needs one), and always at least one."""
    return max(1, config.cpu_threads or available - 1)


def cuda_present() -> bool:
    """Whether the NVIDIA driver is loaded (the launcher never imports torch to ask)."""
    return Path("/proc/driver/nvidia/version").exists()


def cpu_split(config: EngineConfig, allowed: set[int] | None = None) -> CpuSplit | None:
    """The engine's cores and everyone else's, or None (no pinning: a GPU device, or one core only).
    The engine takes config.cpu_threads cores (default: all but one), the highest numbered."""
    on_cpu = config.device == "cpu" or (config.device == "auto" and not cuda_present())
    cores = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    if not on_cpu or len(cores) < 2:
        return None
    take = min(engine_core_count(config, len(cores)), len(cores) - 1)
    return CpuSplit(engine=tuple(cores[-take:]), others=tuple(cores[:-take]))


def engine_core_sets(split: CpuSplit, engines: int) -> list[tuple[int, ...]]:
    """Data parallel: the engine cores dealt out in contiguous runs, one per engine (sizes differ by
    at most one); with fewer cores than engines every engine shares all of them."""
    cores = split.engine
    if len(cores) < engines:
        return [cores] * engines
    bounds = [round(i * len(cores) / engines) for i in range(engines + 1)]
    return [cores[bounds[i] : bounds[i + 1]] for i in range(engines)]


def cpus_env(cpus: tuple[int, ...]) -> dict[str, str]:
    return {ENV: ",".join(map(str, cpus))}


def apply_from_env() -> None:
    """Pin this process to PIPESERVE_CPUS when set (called by each child before anything else)."""
    value = os.environ.get(ENV)
    if value:
        os.sched_setaffinity(0, {int(c) for c in value.split(",")})
