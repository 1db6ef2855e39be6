"""Structured outputs inside the engine: grammars compiled off the step loop, one matcher per
request, and the per-step token bitmask filled on the CPU while the forward pass runs.

- Compilation. A constrained request waits here, not in the scheduler, until its grammar is
  compiled on a background thread, so a slow compilation delays that request alone and never a
  step. Compiled grammars are cached by a hash of the canonical constraint text (LRU), and
  requests with the same constraint share one compilation, even while it runs. The compiler (the
  vocabulary read into xgrammar's TokenizerInfo, seconds with its import) is built on that thread
  while the engine loads its model (`prepare`), so the first constrained request pays only its own
  grammar's compilation (milliseconds on a small vocabulary). A constraint that does not compile fails its
  request (`ready` says why); the tokenizer workers never import xgrammar (nor torch).
- Matchers. Each request owns an xgrammar GrammarMatcher, advanced by every token it samples. It
  belongs to the request, not to its slot: preemption (recompute) only re-prefills tokens the
  matcher has already accepted, and partial prefill chunks sample nothing, so neither touches it.
- Per step. `begin` picks the constrained rows among the rows that sample (a numpy gather by slot;
  nothing happens when no running request is constrained). xgrammar fills their bitmask rows in
  native code while the forward pass runs: on the CPU, where the forward pass occupies this thread,
  a fill thread starts at `begin`; on CUDA, where launching the forward pass returns before the GPU
  is done, this thread fills in `mask`, after the launch (no thread handoff to pay).
  `background_fill` picks either on any device. `mask` returns the rows plus the bitmask on the
  logits' device for the sampler, and `advance` feeds the sampled tokens to the matchers. EOS is
  allowed exactly when the grammar can end (the matcher's stop tokens are the model's EOS ids).

xgrammar (which imports transformers' generation code) is imported on the compile thread, never on
the step's.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pipeserve.engine.sequence import Sequence as Request

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 512
COMPILE_THREADS = 2  # compilations running at once; xgrammar parallelises each one too


@dataclass
class TokenMask:
    """A step's constraint: the logits rows to mask, and an int32 bitmask [B, ceil(V / 32)] on the
    logits' device whose row r is valid for each r in rows (a set bit allows a token)."""

    rows: list[int]
    bitmask: torch.Tensor

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens of the constrained rows to -inf, in place (float32 [B, V]): xgrammar's
        native kernel on the CPU, its Triton kernel on CUDA. Other rows are not touched."""
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, self.bitmask, indices=self.rows)


class StructuredOutputs:
    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        eos_ids: Sequence[int],
        max_num_seqs: int,
        device: torch.device,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.device = device
        self._compile_pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-fill")
        self.background_fill = device.type == "cpu"  # see the module docstring
        self._compiler: Future[xgr.GrammarCompiler] | None = None
        self._grammars: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()
        self.waiting: list[tuple[Request, Future[xgr.CompiledGrammar]]] = []  # in arrival order
        self._compiled: dict[str, xgr.CompiledGrammar] = {}  # rid -> its grammar, until admitted once
        self.matchers: dict[str, xgr.GrammarMatcher] = {}  # rid -> matcher, from first admission to finish
        self._slot_matcher: list[xgr.GrammarMatcher | None] = [None] * max_num_seqs
        self._constrained = np.zeros(max_num_seqs, dtype=bool)  # per slot
        # The fill thread writes host rows; CUDA reads them through pinned memory, uploaded in `mask`.
        shape = (max_num_seqs, (vocab_size + 31) // 32)  # xgrammar's layout: 32 tokens per int32
        self._bitmask_host = torch.full(shape, -1, dtype=torch.int32, device="cpu",
                                       pin_memory=device.type == "cuda")
        on_cpu = device.type == "cpu"
        self._bitmask = (
            self._bitmask_host if on_cpu else torch.full(shape, -1, dtype=torch.int32, device=device)
        )
        self._batch: xgr.BatchGrammarMatcher | None = None  # made with the first matcher
        self._fill: Future[None] | None = None
        self._rows: list[int] = []
        self._row_matchers: list[xgr.GrammarMatcher] = []
        self._num_rows = 0

    # -- compilation ----------------------------------------------------------------------------
    def prepare(self) -> Future[xgr.GrammarCompiler]:
        """Start building the compiler in the background (the engine calls it once it is loaded)."""
        if self._compiler is None or _failed(self._compiler):  # the vocabulary is read once
            self._compiler = self._compile_pool.submit(self._make_compiler)
        return self._compiler

    def submit(self, seq: Request) -> None:
        """Queue a constrained request until its grammar is compiled (see `ready`)."""
        constraint = seq.params.constraint()
        assert constraint is not None, "unconstrained request"
        self.waiting.append((seq, self.compile(*constraint, seq.params.reasoning_format)))

    def compile(self, kind: str, text: str, after: str | None = None) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of a canonical constraint (after: applied from the end of a reasoning
        section of this format), from the cache or a background compile."""
        key = hashlib.sha256(f"{kind}\0{text}\0{after or ''}".encode()).hexdigest()
        future = self._grammars.get(key)
        if future is not None and not _failed(future):
            self._grammars.move_to_end(key)
            return future
        compiler = self.prepare()
        future = self._compile_pool.submit(
            lambda: compiler.result().compile_grammar(_grammar(kind, text, after)))
        self._grammars[key] = future
        while len(self._grammars) > MAX_CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return future

    def _make_compiler(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            self._load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.eos_ids or None
        )
        return xgr.GrammarCompiler(info, max_threads=max(1, min(4, os.cpu_count() or 1)))

    def ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar is done, in arrival order, taken off the waiting list: those that
        can be scheduled, and those whose constraint did not compile, with the reason (the client's
        to fix: "json_schema is invalid: ...")."""
        ok: list[Request] = []
        failed: list[tuple[Request, str]] = []
        still = []
        for seq, future in self.waiting:
            if not future.done():
                still.append((seq, future))
            elif (exc := future.exception()) is not None:
                why = str(exc) if isinstance(exc, ValueError) else f"the grammar did not compile: {exc}"
                failed.append((seq, why))
            else:
                self._compiled[seq.rid] = future.result()
                ok.append(seq)
        self.waiting = still
        return ok, failed

    def wait(self, timeout: float) -> None:
        """Block until some waiting grammar is done, or timeout seconds (the engine has nothing
        else to do)."""
        if self.waiting:
            wait([f for _, f in self.waiting], timeout=timeout, return_when=FIRST_COMPLETED)

    def discard(self, seq: Request) -> bool:
        """Take a request off the waiting list (aborted before its grammar was ready)."""
        before = len(self.waiting)
        self.waiting = [(s, f) for s, f in self.waiting if s is not seq]
        return len(self.waiting) < before

    # -- per-request state ---------------------------------------------------------------------
    def admit(self, seq: Request) -> None:
        """The request got a slot (first admission, or back from preemption with its matcher)."""
        matcher = self.matchers.get(seq.rid)
        if matcher is None:
            import xgrammar as xgr

            matcher = self.matchers[seq.rid] = xgr.GrammarMatcher(self._compiled.pop(seq.rid))
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads=1)  # the fill thread is the parallelism
        self._slot_matcher[seq.slot] = matcher
        self._constrained[seq.slot] = True

    def release(self, seq: Request) -> None:
        self._slot_matcher[seq.slot] = None
        self._constrained[seq.slot] = False

    def finish(self, seq: Request) -> None:
        self.matchers.pop(seq.rid, None)
        self._compiled.pop(seq.rid, None)

    # -- the step ------------------------------------------------------------------------------
    def begin(self, sample_slots: np.ndarray) -> None:
        """Start filling the bitmask rows of this step's constrained rows (rows are indices into
        sample_slots, the slots of the rows that sample, in logits order)."""
        self._num_rows = len(sample_slots)
        if not self.matchers or not self._num_rows:
            self._rows = []
            return
        rows = np.flatnonzero(self._constrained[sample_slots])
        self._rows = rows.tolist()
        if not self._rows:
            return
        self._row_matchers = [m for m in (self._slot_matcher[s] for s in sample_slots[rows]) if m is not None]
        assert len(self._row_matchers) == len(self._rows), "a constrained slot without its matcher"
        if self.background_fill:
            self._fill = self._fill_pool.submit(self._fill_rows)

    def _fill_rows(self) -> None:
        assert self._batch is not None
        self._batch.batch_fill_next_token_bitmask(self._row_matchers, self._bitmask_host, self._rows)

    def mask(self) -> TokenMask | None:
        """This step's TokenMask (call it once the forward pass is launched), or None when no row is
        constrained."""
        if not self._rows:
            return None
        if self._fill is not None:
            self._fill.result()
            self._fill = None
        else:
            self._fill_rows()
        n = self._num_rows
        if self._bitmask is not self._bitmask_host:
            self._bitmask[:n].copy_(self._bitmask_host[:n], non_blocking=True)
        return TokenMask(self._rows, self._bitmask[:n])

    def advance(self, tokens: list[int]) -> None:
        """Feed each constrained row its sampled token (tokens are in logits row order)."""
        if not self._rows:
            return
        import xgrammar as xgr

        accepted = xgr.BatchGrammarMatcher.batch_accept_token(
            self._row_matchers, [tokens[r] for r in self._rows]
        )
        assert all(accepted), "a sampled token broke its grammar: the bitmask was not applied"
        self._rows = []

    def close(self) -> None:
        self._fill_pool.shutdown(wait=True)
        self._compile_pool.shutdown(wait=False, cancel_futures=True)


def _failed(future: Future[Any]) -> bool:
    return future.done() and future.exception() is not None


def _grammar(kind: str, text: str, after: str | None) -> xgr.Grammar:
    from pipeserve.grammar import after_reasoning, build_grammar  # imports xgrammar: not until needed

    return build_grammar(kind, text) if after is None else after_reasoning(after, kind, text)
