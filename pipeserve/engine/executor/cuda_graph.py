"""The CUDA-graph step (CUDA, Triton backend): the decode-rows forward pass captured once per
batch-size bucket as a torch.cuda.CUDAGraph over the block table's full width (the decode kernels
stop at each row's length) and replayed.

Every bucket is captured before the engine serves, largest first, into one graph memory pool that
all buckets share (the largest sizes it; a smaller bucket's replay reuses its blocks, as only one
runs at a time). Buckets stop at `max_cuda_graph_batch` rows: larger steps run eager. Written to the
same interface as the Inductor step, whose CPU tests exercise the bucket, padding and buffer code.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.lora.rows import LoRAContext
from pipeserve.engine.model.llama import LlamaForCausalLM
from pipeserve.startup import progress

from .base import CUDA_GRAPH
from .buffers import StepBuffers
from .padded import PaddedStep

log = logging.getLogger(__name__)


class CudaGraphStep(PaddedStep):
    mode = CUDA_GRAPH
    full_width = True

    def __init__(self, *, model: LlamaForCausalLM, pool: KVPool, buffers: StepBuffers, max_rows: int,
                 max_batch: int, exact: tuple[int, ...] = (), lora: LoRAContext | None = None) -> None:
        """max_batch: the largest bucket captured (--max-cuda-graph-batch). lora: the model's LoRA
        layers' context (each row's slot is then a captured input: padded.py)."""
        super().__init__(model=model, pool=pool, buffers=buffers, top=min(max_rows, max_batch), exact=exact,
                         lora=lora)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capturing: int | None = None  # the bucket prepare() is capturing
        self._pool: Any = None  # the graph memory pool every bucket shares
        self.capture_seconds = 0.0  # prepare()'s time: every bucket captured

    def prepare(self, every_bucket: bool = False) -> None:
        """Every bucket, whatever every_bucket says: none may be captured while serving."""
        start = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        for size in progress(sorted(self.buckets, reverse=True), "capturing CUDA graphs"):
            self._capturing = size
            self.run_scratch(size)
        self._capturing = None
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1f s", len(self.buckets), self.buckets[0],
                 self.buckets[-1], self.capture_seconds)

    def execute(self, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        size = args[0].shape[0]
        entry = self._graphs.get(size)
        if entry is None:
            assert self._capturing == size, f"bucket {size} was not captured before serving"
            entry = self._graphs[size] = self._capture(args)
        entry[0].replay()
        return entry[1]

    def _capture(self, args: tuple[torch.Tensor, ...]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The bucket's forward pass captured over the persistent buffers (their addresses are fixed
        for the engine's life)."""
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward(*args)  # warm-up: lazy initialization (Triton's compiles) never under capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.forward(*args)
        return graph, logits
