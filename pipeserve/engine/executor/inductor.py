"""The Inductor step (CPU, the cpu backend's models the native step does not run): torch.compile per
batch-size bucket. Inductor fuses the elementwise work around the GEMVs into generated C++ and
removes the per-op Python dispatch. The attention's gather width (KV pages read per row) is a
dynamic dimension, so one bucket serves every context length. Compiled code is cached on disk under
pipeserve.config.cache_dir(), so a restart is warm."""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from pipeserve.config import cache_dir
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.lora.rows import LoRAContext
from pipeserve.engine.model.llama import LlamaForCausalLM
from pipeserve.startup import progress

from .base import INDUCTOR
from .buffers import StepBuffers
from .padded import PaddedStep

log = logging.getLogger(__name__)

# Larger decode batches run eager on the CPU: there the step's GEMMs dominate, and every bucket is
# one more compile (docs/engine.md has the measurements).
MAX_INDUCTOR_BATCH = 64
# Compiled before the engine reports ready (with the exact buckets); larger ones compile on first use.
WARM_BUCKETS = (1,)

StepFn = Callable[..., torch.Tensor]


def _own_code(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """fn with a fresh copy of its code object."""
    assert isinstance(fn, types.FunctionType)
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)


def use_cache_dir() -> None:
    """Point Inductor's on-disk cache (generated code, compiled graphs) at pipeserve's cache, unless
    the user chose one. Inductor writes its default into the environment on first use, so that
    value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir(), "inductor")


class InductorStep(PaddedStep):
    mode = INDUCTOR

    def __init__(self, *, model: LlamaForCausalLM, pool: KVPool, buffers: StepBuffers, max_rows: int,
                 exact: tuple[int, ...] = (), whole_graph: bool = True,
                 lora: LoRAContext | None = None) -> None:
        """whole_graph: the forward pass traces as one graph (dense, unquantized models do; the
        expert dispatch of a mixture of experts breaks it). lora: the model's LoRA layers' context."""
        super().__init__(model=model, pool=pool, buffers=buffers, top=min(max_rows, MAX_INDUCTOR_BATCH),
                         exact=exact, lora=lora)
        self.whole_graph = whole_graph
        self._steps: dict[int, StepFn] = {}
        use_cache_dir()

    def prepare(self, every_bucket: bool = False) -> None:
        sizes = self.buckets if every_bucket else set(WARM_BUCKETS).union(self.exact)
        for size in progress(sorted(sizes, reverse=True), "compiling decode steps (inductor)"):
            start = time.perf_counter()
            self.run_scratch(size)
            log.info("compiled the decode step for batch size %d (inductor) in %.1f s", size,
                     time.perf_counter() - start)

    def _step(self, size: int) -> StepFn:
        step = self._steps.get(size)
        if step is None:
            # Dynamo keeps compiled code, guards and its recompile budget per code object: a copy of
            # forward's per bucket gives each bucket of this engine one entry of its own. As one
            # whole graph that entry belongs to this engine's model alone, so guards on its modules
            # can go (checking them costs more than a small model's step). After a graph break the
            # resumed frames are shared code again: then every guard stays. Inductor's `freezing`
            # and `cpp_wrapper` are off: docs/engine.md has what they cost and gained.
            forward = types.MethodType(_own_code(PaddedStep.forward), self)
            # Inductor asserts every input's size and stride on each call (about 75 at batch 1 on
            # the ~18M Llama, 1-3% of its step); the inputs are the runner's persistent buffers,
            # which Dynamo guards, and the model's weights, whose shapes never change.
            options: dict[str, Any] = {"size_asserts": False}
            if self.whole_graph:
                options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
            step = self._steps[size] = torch.compile(
                forward, fullgraph=self.whole_graph, dynamic=False, options=options)
        return step

    def execute(self, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if args[3].shape[1] > 1:  # the gather width
            torch._dynamo.mark_dynamic(args[3], 1)
        return self._step(args[0].shape[0])(*args)
