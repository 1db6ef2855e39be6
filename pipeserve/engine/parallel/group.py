"""The process group of one tensor-parallel engine: rank 0 is the engine itself (scheduler, sampler),
ranks 1..T-1 are worker processes it spawns (pipeserve/engine/parallel/worker.py).

Rendezvous: rank 0 opens a TCPStore on a free port (port 0: the kernel picks, so two engines on one
host never collide) and hands the port to its workers. The group is a torch.distributed backend
object of its own (gloo on CPU, NCCL on CUDA), not the process-global default group, so one process
may hold several engines' groups (an offline user building a second `LLM`, the tests).

Lifetime: `close()` (Engine.close) or garbage collection of the group (dropping an `LLM`), or the
interpreter's exit, sends the workers a stop plan, then kills what has not exited. A worker whose
parent dies without that (SIGKILL) exits on its own: it watches its parent's sentinel.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import threading
import weakref
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import torch
from torch.distributed import (  # type: ignore[attr-defined]  # TCPStore: exported, not in the stubs
    AllreduceOptions,
    BroadcastOptions,
    GatherOptions,
    ProcessGroupGloo,
    ReduceOp,
    TCPStore,
)

from pipeserve.config import EngineConfig

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # the ranks of one engine share a host
# A worker waits in a collective for the next step, as long as the server is idle: the collective
# timeout must outlast any idle period. A dead peer still fails a collective at once (closed socket).
IDLE_TIMEOUT = datetime.timedelta(days=365)
START_TIMEOUT = datetime.timedelta(seconds=300)  # spawning T-1 interpreters that import torch
STOP_TIMEOUT = 10.0  # seconds a worker gets to leave its loop before it is killed


class TPGroup:
    """One rank's view of its engine's group, and the collectives the sharded model uses."""

    def __init__(self, rank: int, world: int, store: TCPStore, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.pg: Any
        if device.type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = IDLE_TIMEOUT
            self.pg = ProcessGroupNCCL(store, rank, world, opts)
        else:
            gloo = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the devices option
            gloo._devices = [ProcessGroupGloo.create_device(hostname=HOST)]
            gloo._timeout = IDLE_TIMEOUT
            self.pg = ProcessGroupGloo(store, rank, world, gloo)
        self._store = store  # the workers' rendezvous point lives as long as rank 0's group
        self._stop: weakref.finalize[..., TPGroup] | None = None

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, sends the step plan, samples."""
        return self.rank == 0

    # -- collectives ----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place."""
        self.pg.allreduce([tensor], AllreduceOptions()).wait()

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's (same shape and dtype), in place."""
        _broadcast(self.pg, tensor)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape), in rank order, on rank 0; None on the others."""
        opts = GatherOptions()
        opts.rootRank = 0
        if not self.is_driver:
            self.pg.gather([], [tensor], opts).wait()
            return None
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        self.pg.gather([parts], [tensor], opts).wait()
        return parts

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV pages every rank can hold)."""
        t = torch.tensor([-value], dtype=torch.int64, device=self.device)
        self.all_reduce_max(t)
        return -int(t.item())

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(ReduceOp.MAX)
        self.pg.allreduce([tensor], opts).wait()

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Rank 0: stop the workers (idempotent; also run when the group is collected or at exit)."""
        if self._stop is not None:
            self._stop()


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from the configured one (cuda:r for auto or cuda), else the CPU."""
    cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    if not cuda:
        return torch.device("cpu")
    first = torch.device(config.device).index if config.device.startswith("cuda") else None
    return torch.device("cuda", (first or 0) + rank)


def check_devices(config: EngineConfig) -> None:
    """ValueError when the host cannot give every rank its own GPU."""
    last = rank_device(config, config.tensor_parallel_size - 1)
    if last.type == "cuda" and torch.cuda.device_count() <= (last.index or 0):
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} from {config.device} needs "
                         f"{last} but {torch.cuda.device_count()} GPUs are visible")


def start(config: EngineConfig) -> TPGroup:
    """Rank 0: spawn ranks 1..T-1 and rendezvous with them. On the CPU the engine's torch threads
    are split among the ranks (each rank computes its own shard on its own cores)."""
    from . import worker  # the workers' entry point; it imports the engine lazily

    check_devices(config)
    world = config.tensor_parallel_size
    device = rank_device(config, 0)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        threads = max(1, threads // world)
        torch.set_num_threads(threads)
    store = TCPStore(HOST, 0, world, True, timeout=START_TIMEOUT, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=worker.main, args=(config, rank, world, store.port, threads), daemon=True,
                    name=f"pipeserve: engine rank {rank}")
        for rank in range(1, world)
    ]
    for proc in procs:
        proc.start()
    log.info("tensor parallel: %d ranks on %s, rendezvous %s:%d, workers %s", world, device.type, HOST,
             store.port, [p.pid for p in procs])
    try:
        group = TPGroup(0, world, store, device)
    except BaseException:
        _stop_workers(None, procs, device)
        raise
    group._stop = weakref.finalize(group, _stop_workers, group.pg, procs, device)
    return group


def join(config: EngineConfig, rank: int, world: int, port: int) -> TPGroup:
    """Rank r > 0: join rank 0's group."""
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = TCPStore(HOST, port, world, False, timeout=START_TIMEOUT)
    return TPGroup(rank, world, store, device)


def _broadcast(pg: Any, tensor: torch.Tensor) -> None:
    opts = BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


def _stop_workers(pg: Any, procs: Sequence[BaseProcess], device: torch.device) -> None:
    """Send the stop plan (workers leave their loop and exit), then kill any worker still running.
    Holds no reference to the group: it runs when the group is collected."""
    from .step_plan import stop_header

    if pg is not None and any(p.is_alive() for p in procs):
        try:
            _broadcast(pg, stop_header(device))
        except Exception:  # a dead worker fails the broadcast: the join and kill below still run
            log.warning("could not send the stop plan to every rank", exc_info=True)
    for proc in procs:
        proc.join(STOP_TIMEOUT)
        if proc.is_alive():
            log.warning("engine rank %s did not stop: killing it", proc.name)
            proc.kill()
            proc.join()


def exit_with_parent() -> None:
    """Worker side: leave at once when the parent (rank 0) dies, whatever the worker is doing (a rank
    0 killed with SIGKILL sends no stop plan)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
