"""Ranks 1..T-1 of a tensor-parallel engine: each loads its shard and its KV pool the way rank 0 does
(it builds an Engine with the group, which loads the shard), then runs the step loop: receive rank
0's step plan, run the forward pass on its shard (the collectives meet rank 0's), and take part in
the gather of the logits. No scheduling and no sampling happen here."""

from __future__ import annotations

import logging
import signal

import torch

from pipeserve.config import EngineConfig

from .group import exit_with_parent, join
from .step_plan import StepReceiver

log = logging.getLogger(__name__)


def main(config: EngineConfig, rank: int, world: int, port: int, threads: int) -> None:
    """The worker process's entry point (spawned by group.start)."""
    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C reaches every rank; rank 0 decides
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank {rank} %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(threads)
    from pipeserve.engine.engine import Engine  # the engine module imports this one

    group = join(config, rank, world, port)
    engine = Engine(config, tp=group)
    caches = engine.pool.layers
    receiver = StepReceiver(group, caches[0].seq_of_page if caches else None)
    model = engine.model
    steps = 0
    while (step := receiver.receive()) is not None:
        hidden = model(step.input_ids, step.positions, step.meta, caches)
        if step.num_sampled:
            model.compute_logits(hidden)
        steps += 1
    log.info("rank %d stops after %d steps", rank, steps)
