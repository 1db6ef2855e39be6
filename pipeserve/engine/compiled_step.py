"""Steps as one unit: the native step, or one compiled unit per batch-size bucket.

For Inductor and CUDA graphs, a step whose rows are all decode rows (one query token each) is padded
up to the smallest bucket (1, 2, 4, 8, ... up to its most rows; on the CPU up to MAX_INDUCTOR_BATCH)
that holds it and run through that bucket's compiled forward pass: embedding, every layer, the final
norm and the logits. Its inputs are the runner's persistent buffers (same storage every step),
refilled in place. Padded rows read and write only a scratch KV page reserved for them, and their
logits are cut off before the sampler, so they never touch a request's cache or sampling state.

The same buffers drive three kinds of step:
- "native" (CPU, dense fp32 models): one native call runs the whole forward pass for any row count
  (native_step.py), so nothing is padded and there is nothing to compile beyond the kernels' C++.
- "inductor" (CPU, every other model the cpu backend runs): torch.compile per bucket. Inductor
  fuses the elementwise work around the GEMVs into generated C++ and removes the per-op Python
  dispatch. The attention's gather width (KV pages read per row) is a dynamic dimension, so one
  bucket serves every context length.
- "cuda-graph" (CUDA, Triton backend): the eager forward pass captured once per bucket as a
  torch.cuda.CUDAGraph over the full page-table width (the decode kernels stop at each row's
  length) and replayed. Written to the same interface and never run in this repository's history
  (no GPU).

A speculative verification chunk (a request's newest token and its k proposals) runs here too, as
1 + k decode rows sharing the request's block table: row j at position p + j with seq_len p + j + 1.
Every layer stores all rows' K/V before any row attends, so the seq_len alone makes it causal.
The native step runs prefill chunks' rows the same way, in steps of up to NATIVE_MERGED_ROWS rows;
other steps with prefill rows stay on the eager path.
Compiled code is cached on disk under pipeserve.config.cache_dir(), so a restart is warm.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pipeserve.config import cache_dir
from pipeserve.engine import native_step
from pipeserve.engine.kv.metadata import AttentionMetadata
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.model.llama import LlamaForCausalLM
from pipeserve.startup import progress

log = logging.getLogger(__name__)

MODES = ("native", "inductor", "cuda-graph")
# Larger decode batches run eager on the CPU: there the step's GEMMs dominate, and every bucket is
# one more compile (docs/engine.md has the measurements). CUDA graphs cover every batch size.
MAX_INDUCTOR_BATCH = 64
# Rows a native step takes at least, so that merged steps (decode rows beside a short prompt or a
# chunk of one) run native too; a longer chunk runs eager, where prefill attention reads each page
# once per chunk instead of once per row (docs/engine.md has the measurements).
NATIVE_MERGED_ROWS = 64
# Compiled before the engine reports ready; larger buckets compile on first use.
WARM_BUCKETS = (1,)

_FORWARD = inspect.unwrap(LlamaForCausalLM.forward)
_LOGITS = inspect.unwrap(LlamaForCausalLM.compute_logits)


def _own_code(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """fn with a fresh copy of its code object."""
    assert isinstance(fn, types.FunctionType)
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)


Stage = Callable[[str, np.ndarray], torch.Tensor]
StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def compile_mode(enabled: bool, backend: str, device: torch.device) -> str | None:
    """Which compiler runs decode steps: inductor for the cpu backend on the CPU, CUDA graphs for
    the Triton backend on CUDA (the cpu backend's per-step memos would be frozen into a captured
    graph); None when disabled, for the reference oracle, and for Triton under its CPU interpreter."""
    if not enabled or backend == "reference":
        return None
    if device.type == "cuda":
        return "cuda-graph" if backend == "triton" else None
    if device.type == "cpu" and backend in ("cpu", "torch"):
        if shutil.which(os.environ.get("CXX") or "g++") is None:  # Inductor builds C++ with it
            log.warning("no C++ compiler (g++, or $CXX) on this host: decode steps run eager")
            return None
        return "inductor"
    return None


def step_mode(mode: str, model: LlamaForCausalLM, pool: KVPool) -> str:
    """compile_mode's choice for this model: on the CPU, the native step where it runs the model
    (unless $PIPESERVE_NATIVE_STEP is 0, for comparisons), else Inductor."""
    if mode not in ("native", "inductor"):
        return mode
    if os.environ.get("PIPESERVE_NATIVE_STEP", "1") != "0" and native_step.unsupported(model, pool) is None:
        return "native"
    return "inductor"


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two below max_num_seqs, then max_num_seqs itself."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return (*sizes, max_num_seqs)


def use_cache_dir() -> None:
    """Point Inductor's on-disk cache (generated code, compiled graphs) at pipeserve's cache, unless
    the user chose one. Inductor writes its default into the environment on first use, so that
    value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir(), "inductor")


class CompiledDecode:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool, max_rows: int, mode: str,
                 whole_graph: bool = True, exact: tuple[int, ...] = ()) -> None:
        """max_rows: the most decode rows a step can have (max_num_seqs, times 1 + k when each may
        verify k proposals). whole_graph: the forward pass traces as one graph (dense, unquantized
        models do; the expert dispatch of a mixture of experts breaks it). exact: row counts that
        get a bucket of their own (a batch-1 verification step's 1 + j rows: padding them up to a
        power of two adds whole rows of products, and on the CPU MKL's F.linear over 4 rows cost
        twice its 3; the cpu backend's packed product narrows that gap)."""
        assert mode in MODES, mode
        self.model, self.pool, self.mode = model, pool, mode
        self.whole_graph = whole_graph
        if mode == "native":  # every row count runs as itself, merged steps' prefill rows too
            self.buckets: tuple[int, ...] = tuple(range(1, max(max_rows, NATIVE_MERGED_ROWS) + 1))
        else:
            top = batch_buckets(min(max_rows, MAX_INDUCTOR_BATCH) if mode == "inductor" else max_rows)
            self.buckets = tuple(sorted(set(top).union(n for n in exact if n < top[-1])))
        self.exact = tuple(n for n in exact if n <= self.buckets[-1])  # compiled before serving too
        self.page_size = pool.page_size
        # Padded rows (and warm-up steps) write their K/V here; a native step pads nothing and has
        # nothing to warm up, so it takes no page from the pool.
        self.scratch_page = -1 if mode == "native" else pool.reserve_scratch_page()
        self._steps: dict[int, StepFn] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._native = native_step.NativeStep(model, pool, self.buckets[-1]) if mode == "native" else None
        if mode == "inductor":
            use_cache_dir()

    def covers(self, num_decode: int, num_tokens: int) -> bool:
        """Whether a step of num_tokens rows, num_decode of them decode rows (one query each,
        attending up to its own position: verification rows count), runs compiled. A native step
        takes prefill chunks' rows too (merged steps): the same per-row attention, and no shape to
        compile for."""
        if self.mode == "native":
            return 0 < num_tokens <= self.buckets[-1]
        return 0 < num_decode == num_tokens <= self.buckets[-1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # -- the forward pass ------------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of a decode batch; the gather width is the tables' page count."""
        empty = block_tables[:0]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode=input_ids.shape[0],
            decode_block_tables=block_tables,
            decode_seq_lens=seq_lens,
            prefill_block_tables=empty,
            prefill_cu_q_lens=seq_lens[:1],
            prefill_seq_lens=seq_lens[:0],
            prefill_max_q_len=0,
            prefill_max_seq_len=0,
            decode_max_seq_len=block_tables.shape[1] * self.page_size,
        )
        # The undecorated methods: Inductor cannot trace an inference_mode context inside the
        # compiled region (views of buffers fail), so run() enters it outside.
        hidden = _FORWARD(self.model, input_ids, positions, meta, self.pool.layer_views())
        logits: torch.Tensor = _LOGITS(self.model, hidden)
        return logits

    def _step(self, size: int) -> StepFn:
        step = self._steps.get(size)
        if step is None:
            # Dynamo keeps compiled code, guards and its recompile budget per code object: a copy of
            # _forward's per bucket gives each bucket of this engine one entry of its own. As one
            # whole graph that entry belongs to this engine's model alone, so guards on its modules
            # can go (checking them costs more than a small model's step). After a graph break the
            # resumed frames are shared code again: then every guard stays. Inductor's `freezing`
            # and `cpp_wrapper` are off: docs/engine.md has what they cost and gained.
            forward = types.MethodType(_own_code(CompiledDecode._forward), self)
            # Inductor asserts every input's size and stride on each call (about 75 at batch 1 on
            # the ~18M Llama, 1-3% of its step); the inputs are the runner's persistent buffers,
            # which Dynamo guards, and the model's weights, whose shapes never change.
            options: dict[str, Any] = {"size_asserts": False}
            if self.whole_graph:
                options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
            step = self._steps[size] = torch.compile(
                forward, fullgraph=self.whole_graph, dynamic=False, options=options)
        return step

    # -- a step ------------------------------------------------------------------------------------
    def pad(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            tables: np.ndarray) -> tuple[np.ndarray, ...]:
        """The step's host arrays padded to its bucket; tables: its rows of the block table."""
        n = input_ids.shape[0]
        size = self.bucket(n)
        width = tables.shape[1] if self.mode == "cuda-graph" else self.gather_width(positions)
        ids = np.zeros(size, np.int64)
        pos = np.zeros(size, np.int64)
        slots = np.full(size, self.scratch_page * self.page_size, np.int64)
        table = np.full((size, width), self.scratch_page, np.int32)
        lens = np.ones(size, np.int32)
        ids[:n], pos[:n], slots[:n], lens[:n] = input_ids, positions, slot_mapping, positions + 1
        table[:n] = tables[:, :width]
        return ids, pos, slots, table, lens

    def gather_width(self, positions: np.ndarray) -> int:
        """KV pages an inductor step reads per row: enough for its longest row, at least 2 (a width
        of 1 would be specialized as a constant), at most the table's width."""
        need = int(positions.max()) // self.page_size + 1
        return min(max(need, 2), self.pool.max_pages_per_seq)

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            tables: np.ndarray, stage: Stage) -> torch.Tensor:
        """Logits [n, V] of a step of n rows (n <= the largest bucket; decode and verification rows,
        and for a native step prefill rows too). stage copies a host array into the runner's
        persistent device buffer of that name."""
        n = input_ids.shape[0]
        if self._native is not None:  # reads the host arrays directly: no padding, no staging
            return self._native(input_ids, positions, slot_mapping, tables, positions + 1)
        ids, pos, slots, table, lens = self.pad(input_ids, positions, slot_mapping, tables)
        args = (
            stage("input_ids", ids),
            stage("positions", pos),
            stage("slot_mapping", slots),
            stage("decode_block_tables", table),
            stage("decode_seq_lens", lens),
        )
        size = ids.shape[0]
        with torch.inference_mode():
            if self.mode == "cuda-graph":
                return self._replay(size, args)[:n]
            if table.shape[1] > 1:
                torch._dynamo.mark_dynamic(args[3], 1)
            return self._step(size)(*args)[:n]

    def _replay(self, size: int, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """CUDA: capture the bucket's forward pass on first use (the buffers' addresses are fixed
        for the engine's life), then replay it."""
        entry = self._graphs.get(size)
        if entry is None:
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(*args)  # warm-up: lazy initialization must not happen under capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._forward(*args)
            entry = self._graphs[size] = (graph, logits)
        entry[0].replay()
        return entry[1]

    def warm_up(self, stage: Stage, every_bucket: bool = False) -> None:
        """Compile (or capture) the default buckets and the exact ones (every_bucket: all of them)
        before the engine serves: one step each over the scratch page alone, which no request reads.
        A native step compiles nothing here (its library is built when the backend loads)."""
        if self.mode == "native":
            return
        sizes = [s for s in (self.buckets if every_bucket else sorted(set(WARM_BUCKETS).union(self.exact)))
                 if s <= self.buckets[-1]]
        for size in progress(sizes, f"compiling decode steps ({self.mode})"):
            zeros = np.zeros(size, np.int64)
            slots = np.full(size, self.scratch_page * self.page_size, np.int64)
            tables = np.full((size, self.pool.max_pages_per_seq), self.scratch_page, np.int32)
            self.run(zeros, zeros, slots, tables, stage)
            log.info("compiled the decode step for batch size %d (%s)", size, self.mode)
