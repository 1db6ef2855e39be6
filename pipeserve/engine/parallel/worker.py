"""Ranks 1..T-1 of a tensor-parallel engine: each loads its shard and its KV pool the way rank 0 does
(pipeserve/engine/shard.py), then runs `RankRunner`'s loop: receive rank 0's step plan, run the
forward pass on its shard (the collectives meet rank 0's), and take part in the gather of the
logits. No scheduler, sampler or request state lives here; with LoRA, the rank's slot table follows
rank 0's through the plans (pipeserve/engine/lora/tensor_parallel.py). A failure is sent to rank 0
(its own traceback) before the rank exits, so the engine raises with it."""

from __future__ import annotations

import logging
import signal
import sys
from multiprocessing.connection import Connection

import torch

from pipeserve.config import EngineConfig
from pipeserve.engine.host_memory import keep_freed_memory
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.lora.tensor_parallel import RankAdapters
from pipeserve.engine.model.llama import LlamaForCausalLM
from pipeserve.engine.shard import build_pool, load_shard

from .group import TPGroup, exit_with_parent, join, report_failure
from .step_plan import StepReceiver

log = logging.getLogger(__name__)


class RankRunner:
    """A rank's step loop over its shard: the model input comes from rank 0's plan, the logits of
    the sampled rows go back to rank 0 through the gather inside `compute_logits`."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, group: TPGroup,
                 adapters: RankAdapters | None = None) -> None:
        """adapters: the rank's LoRA slot table and layers (None: LoRA is off)."""
        self.model, self.caches, self.adapters = model, pool.layers, adapters
        self.receiver = StepReceiver(group, self.caches[0].seq_of_page if self.caches else None,
                                     0 if adapters is None else adapters.descriptor_size)
        self.steps = 0

    def run(self) -> None:
        """Run steps until rank 0 sends the stop plan."""
        while (step := self.receiver.receive()) is not None:
            if self.adapters is not None:
                self.adapters.step(step.adapters, step.loads)
            hidden = self.model(step.input_ids, step.positions, step.meta, self.caches)
            if step.num_sampled:
                self.model.compute_logits(hidden)
            self.steps += 1


def main(config: EngineConfig, rank: int, world: int, port: int, threads: int, pipe: Connection) -> None:
    """A rank's entry point (the target group.start spawns)."""
    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C reaches every rank; rank 0 decides
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank {rank} %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(threads)
    try:
        group = join(config, rank, world, port, pipe)
        if group.device.type == "cpu":  # as rank 0's engine does
            keep_freed_memory()
        shard = load_shard(config, group)
        # The pool first: its budget counts the slot table's bytes itself (as rank 0's does), which an
        # allocated table would add a second time.
        pool = build_pool(config, shard, group)
        adapters = None
        if config.enable_lora:  # after the backend prepared the model's linears: the adapters wrap them
            adapters = RankAdapters(model=shard.model, cfg=shard.model_config, max_loras=config.max_loras,
                                    max_lora_rank=config.max_lora_rank, max_num_seqs=config.max_num_seqs,
                                    rank=rank, world=world, dtype=shard.dtype, device=shard.device)
        runner = RankRunner(shard.model, pool, group, adapters)
        runner.run()
    except BaseException:
        log.exception("rank %d failed", rank)
        report_failure(pipe)
        sys.exit(1)
    log.info("rank %d stops after %d steps", rank, runner.steps)
