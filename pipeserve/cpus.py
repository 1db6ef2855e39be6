"""How the pipeline's processes share a CPU-only host's cores.

On a CPU device the engine computes on the host's cores, and every other process (gateway, tokenizers,
detokenizer) wakes up for each request and step. Sharing cores, they evict the engine's caches and
preempt its threads, so each request's first step runs cold (docs/engine.md has the measured cost).
So the launcher gives the engine its own cores and the rest of the pipeline the remaining ones. On a
GPU host the engine's CPU work is light and nothing is pinned.
Children read their set from PIPESERVE_CPUS (applied first thing in the fresh interpreter, before it
starts any thread, so every thread inherits it).

Several servers on one host must not pin their engines to the same cores: a launcher claims its
engine cores host-wide (`claim_split`), one flock'd file per core in a registry directory every
user can write (/dev/shm, else the temp dir). A lock lives as long as the launcher's open file, so a
crashed launcher frees its cores at once. An engine takes only free cores; when none is free it runs
unpinned, and the log says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeserve.config import EngineConfig

ENV = "PIPESERVE_CPUS"
log = logging.getLogger("pipeserve.cpus")


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


def cpu_split(config: EngineConfig, allowed: set[int] | None = None,
              free: Callable[[int], bool] = lambda core: True) -> CpuSplit | None:
    """The engine's cores and everyone else's, or None (no pinning: a GPU device, one core only, or
    no core `free` for an engine). The engine takes config.cpu_threads cores (default: all but one),
    the highest numbered among the free ones; the rest of the pipeline gets every other core."""
    on_cpu = config.device == "cpu" or (config.device == "auto" and not cuda_present())
    cores = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    if not on_cpu or len(cores) < 2:
        return None
    take = min(engine_core_count(config, len(cores)), len(cores) - 1)
    engine: list[int] = []
    for core in reversed(cores):  # in order, so that `free` (a claim) is asked only for cores taken
        if len(engine) == take:
            break
        if free(core):
            engine.append(core)
    if not engine:
        return None
    return CpuSplit(engine=tuple(sorted(engine)), others=tuple(c for c in cores if c not in engine))


def registry_dir() -> Path:
    """Where engines' core claims live: shared by every user of the host (sticky, like /tmp)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / "pipeserve-cores"


@contextlib.contextmanager
def claim_split(config: EngineConfig, registry: Path | None = None,
                allowed: set[int] | None = None) -> Iterator[CpuSplit | None]:
    """cpu_split over the cores no other pipeserve engine on this host holds, those cores held for
    the block (None: nothing to pin, or every core held elsewhere: the engine runs unpinned)."""
    where = registry or registry_dir()
    held: dict[int, int] = {}  # core -> the open, locked file that holds it
    elsewhere: list[int] = []  # cores another engine holds

    def claim(core: int) -> bool:
        fd = _lock(where, core)
        if fd is None:
            elsewhere.append(core)
        else:
            held[core] = fd
        return fd is not None

    try:
        split = cpu_split(config, allowed, claim)
        if split is None and elsewhere:
            log.warning("every core is held by another pipeserve engine on this host (%s): this engine "
                        "runs unpinned, sharing cores", where)
        elif split is not None and elsewhere:
            log.warning("cores %s are held by other pipeserve engines on this host: this one takes %s",
                        sorted(elsewhere), split.engine)
        yield split
    finally:
        for fd in held.values():
            os.close(fd)


def _lock(registry: Path, core: int) -> int | None:
    """An open file holding `core` for this process (released when closed or when it dies), or None
    when another process holds it."""
    try:
        if not registry.is_dir():
            registry.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(PermissionError):  # another user made it
                registry.chmod(0o1777)
        fd = os.open(registry / f"core-{core}", os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError as exc:  # a registry this user cannot write: claim nothing rather than fail
        log.warning("cannot claim core %d in %s (%s)", core, registry, exc.strerror)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


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
