"""The process group of one tensor-parallel engine: rank 0 is the engine itself (scheduler, sampler),
ranks 1..T-1 are processes it spawns, each running the target it is given (the engine gives
pipeserve/engine/parallel/worker.py's `main`).

Rendezvous: rank 0 opens a TCPStore on a free port (port 0: the kernel picks, so two engines on one
host never collide) and hands the port to its ranks. The group is a torch.distributed backend
object of its own (gloo on CPU, NCCL on CUDA), not the process-global default group, so one process
may hold several engines' groups (an offline user building a second `LLM`, the tests).

Failure: each rank holds the write end of a pipe to rank 0. It says when it joins, and when it
fails it sends its own traceback before it exits. Rank 0 waits for every rank to join while
watching their processes, so a rank that dies before it joins (one that raised, was killed, or never
ran its target: a script without an `if __name__ == "__main__":` guard re-imported by the spawned
interpreter) fails `start` at once. After that a watchdog thread sees a rank exit; a collective that
fails (gloo: the dead peer's socket closes; NCCL: the watchdog aborts the group) raises
`RankFailed` with that rank's own error. The engine process then exits, and `pipeserve up`
restarts it with new ranks.

Lifetime: `close()` (Engine.close) or garbage collection of the group (dropping an `LLM`), or the
interpreter's exit, sends the ranks a stop plan, then kills what has not exited. A rank whose
parent dies without that (SIGKILL) exits on its own: it watches its parent's sentinel.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
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
# A rank waits in a collective for the next step, as long as the server is idle: the collective
# timeout must outlast any idle period. A dead peer fails a collective at once (closed socket, or
# the watchdog's abort).
IDLE_TIMEOUT = datetime.timedelta(days=365)
START_TIMEOUT = datetime.timedelta(seconds=300)  # spawning T-1 interpreters that import torch
CONNECT_TIMEOUT = datetime.timedelta(seconds=60)  # every rank has joined: the group's own set-up
STOP_TIMEOUT = 10.0  # seconds a rank gets to leave its loop before it is killed
FAILURE_WAIT = 5.0  # seconds a failed collective waits for the rank that broke it to be seen exiting
JOINED, FAILED = "joined", "failed"  # what a rank says on its pipe

# A rank's entry point: (config, rank, world, store port, torch threads, pipe to rank 0).
Target = Callable[[EngineConfig, int, int, int, int, Connection], None]


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or raised; the message carries its own error."""


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
        self._store = store  # the ranks' rendezvous point lives as long as rank 0's group
        self._stop: weakref.finalize[..., TPGroup] | None = None
        self.ranks: Ranks | None = None  # rank 0: the other ranks' processes

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, sends the step plan, samples."""
        return self.rank == 0

    # -- collectives ----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place."""
        self._wait(self.pg.allreduce([tensor], AllreduceOptions()))

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's (same shape and dtype), in place."""
        self._wait(_broadcast(self.pg, tensor))

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape), in rank order, on rank 0; None on the others."""
        opts = GatherOptions()
        opts.rootRank = 0
        if not self.is_driver:
            self._wait(self.pg.gather([], [tensor], opts))
            return None
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        self._wait(self.pg.gather([parts], [tensor], opts))
        return parts

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV pages every rank can hold)."""
        t = torch.tensor([-value], dtype=torch.int64, device=self.device)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(ReduceOp.MAX)
        self._wait(self.pg.allreduce([t], opts))
        return -int(t.item())

    def _wait(self, work: Any) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            failed = None if self.ranks is None else self.ranks.failure(FAILURE_WAIT)
            if failed is None:  # rank > 0 (rank 0 reports the failure), or no rank died
                raise
            raise failed from exc

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Rank 0: stop the other ranks (idempotent; also run when the group is collected or at exit)."""
        if self._stop is not None:
            self._stop()


class Ranks:
    """Rank 0's view of ranks 1..T-1: their processes, their pipes, and what each said it died of."""

    def __init__(self, procs: Sequence[BaseProcess], pipes: Sequence[Connection]) -> None:
        self.procs, self.pipes = list(procs), list(pipes)
        self.errors: dict[int, str] = {}  # rank -> its own traceback, when it sent one
        self.stopping = False
        self.on_death: Callable[[], None] | None = None  # run by the watchdog (NCCL: abort the group)

    def _read(self, rank: int) -> list[str]:
        """Every message rank `rank` sent so far (a failure's traceback is kept)."""
        said = []
        pipe = self.pipes[rank - 1]
        try:
            while pipe.poll():
                kind, text = pipe.recv()
                said.append(kind)
                if kind == FAILED:
                    self.errors[rank] = text
        except (EOFError, OSError):  # the rank exited: nothing more to read
            pass
        return said

    def describe(self, rank: int) -> str:
        self._read(rank)
        proc = self.procs[rank - 1]
        if rank in self.errors:
            return f"tensor-parallel rank {rank} failed:\n{self.errors[rank]}"
        code = proc.exitcode
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        elif code is not None:
            how = f"exited with code {code} before it could report an error (see its stderr)"
        else:
            how = "is running but a collective with it failed"
        return f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"

    def exited(self, timeout: float | None) -> list[int]:
        """The ranks whose process exited, waiting up to `timeout` for one (None: until one does).
        A process's sentinel is ready a moment before it can be reaped: each is joined here."""
        ready = set(wait([p.sentinel for p in self.procs], timeout))
        dead = []
        for rank, proc in enumerate(self.procs, 1):
            if proc.sentinel in ready:
                proc.join()
                dead.append(rank)
        return dead

    def wait_joined(self, timeout: float) -> None:
        """Block until every rank said it joined; RankFailed as soon as one dies first."""
        waiting = set(range(1, len(self.procs) + 1))
        deadline = time.monotonic() + timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailed(f"tensor-parallel ranks {sorted(waiting)} did not start in {timeout:.0f} s")
            handles: list[Any] = [self.pipes[r - 1] for r in waiting]
            handles += [self.procs[r - 1].sentinel for r in waiting]
            wait(handles, left)
            for rank in sorted(waiting):
                if JOINED in self._read(rank):
                    waiting.discard(rank)
            dead = [r for r in self.exited(0) if r in waiting]
            if dead:
                rank = dead[0]
                self._read(rank)
                # Exit code 1 without a word: the spawned interpreter failed before the target ran.
                silent = rank not in self.errors and self.procs[rank - 1].exitcode == 1
                raise RankFailed(self.describe(rank) + (MAIN_GUARD_HINT if silent else ""))

    def failure(self, timeout: float) -> RankFailed | None:
        """After a failed collective: the error of the first rank seen dead within `timeout`."""
        dead = self.exited(timeout)
        return RankFailed(self.describe(dead[0])) if dead else None

    def watch(self) -> None:
        """Start the watchdog: a rank that exits while the group is in use runs `on_death` once."""

        def run() -> None:
            # Only waits: joining here would race the main thread's join for the exit status.
            ready = wait([p.sentinel for p in self.procs])
            if not self.stopping:
                dead = [r for r, p in enumerate(self.procs, 1) if p.sentinel in ready]
                log.error("tensor-parallel rank(s) %s exited; the next step fails", dead)
                if self.on_death is not None:
                    self.on_death()

        threading.Thread(target=run, name="tp-watchdog", daemon=True).start()


MAIN_GUARD_HINT = (
    "\nA rank is a fresh interpreter that imports the script that started it: a script that builds an "
    "LLM with tensor_parallel_size > 1 must do it under `if __name__ == \"__main__\":`."
)


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


def start(config: EngineConfig, target: Target) -> TPGroup:
    """Rank 0: spawn ranks 1..T-1 running `target` and rendezvous with them; RankFailed with a rank's
    own error when one dies first. On the CPU the engine's torch threads are split among the ranks
    (each rank computes its own shard on its own cores)."""
    check_devices(config)
    world = config.tensor_parallel_size
    device = rank_device(config, 0)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        threads = max(1, threads // world)
        torch.set_num_threads(threads)
    store = TCPStore(HOST, 0, world, True, timeout=START_TIMEOUT, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    ranks = Ranks([], [])
    try:
        for rank in range(1, world):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=target, args=(config, rank, world, store.port, threads, writer),
                               daemon=True, name=f"pipeserve: engine rank {rank}")
            proc.start()
            writer.close()  # the rank holds the write end now
            ranks.procs.append(proc)
            ranks.pipes.append(reader)
        log.info("tensor parallel: %d ranks on %s, rendezvous %s:%d, ranks 1..%d are pids %s", world,
                 device.type, HOST, store.port, world - 1, [p.pid for p in ranks.procs])
        ranks.wait_joined(START_TIMEOUT.total_seconds())
        store.set_timeout(CONNECT_TIMEOUT)  # every rank is connecting now
        group = TPGroup(0, world, store, device)
    except BaseException as exc:
        # A rank that died while the group connected: its own error rather than the rendezvous's.
        rendezvous = isinstance(exc, RuntimeError) and not isinstance(exc, RankFailed)
        failed = ranks.failure(0) if rendezvous else None
        _stop_ranks(None, ranks, device)
        if failed is not None:
            raise failed from exc
        raise
    group.ranks = ranks
    if device.type == "cuda":  # NCCL does not notice a dead peer: unblock what waits for it
        ranks.on_death = group.pg.abort
    ranks.watch()
    group._stop = weakref.finalize(group, _stop_ranks, group.pg, ranks, device)
    return group


def join(config: EngineConfig, rank: int, world: int, port: int, pipe: Connection) -> TPGroup:
    """Rank r > 0: tell rank 0, then join its group."""
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = TCPStore(HOST, port, world, False, timeout=START_TIMEOUT)
    pipe.send((JOINED, ""))
    return TPGroup(rank, world, store, device)


def report_failure(pipe: Connection) -> None:
    """Rank r > 0, in its `except`: send rank 0 this rank's own traceback (best effort)."""
    try:
        pipe.send((FAILED, traceback.format_exc()))
    except OSError:  # rank 0 is gone: nobody to tell
        pass


def _broadcast(pg: Any, tensor: torch.Tensor) -> Any:
    opts = BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([tensor], opts)


def _stop_ranks(pg: Any, ranks: Ranks, device: torch.device) -> None:
    """Send the stop plan (the ranks leave their loop and exit), then kill any rank still running.
    Holds no reference to the group: it runs when the group is collected."""
    from .step_plan import stop_header

    ranks.stopping = True
    procs = ranks.procs
    if pg is not None and all(p.is_alive() for p in procs):
        try:
            _broadcast(pg, stop_header(device)).wait()
        except Exception:  # a rank that died meanwhile fails the broadcast: the join and kill still run
            log.warning("could not send the stop plan to every rank", exc_info=True)
    for proc in procs:
        proc.join(STOP_TIMEOUT if pg is not None else 0)
        if proc.is_alive():
            log.warning("%s did not stop: killing it", proc.name)
            proc.kill()
            proc.join()
    for pipe in ranks.pipes:
        pipe.close()


def exit_with_parent() -> None:
    """Rank r > 0: leave at once when the parent (rank 0) dies, whatever the rank is doing (a rank
    0 killed with SIGKILL sends no stop plan)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
