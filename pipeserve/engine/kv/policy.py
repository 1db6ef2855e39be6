"""Admission policies: how much KV a request reserves when admitted, and whom to preempt when the
pool runs dry. The pool enforces the promises; a policy only sizes them."""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from typing import Any, Protocol

from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.sequence import Sequence


class AdmissionPolicy(Protocol):
    name: str

    def reservation_tokens(self, seq: Sequence, max_model_len: int) -> int:
        """Tokens of KV to promise this request at admission (at least the tokens it prefills)."""
        ...

    def admits(self, seq: Sequence, running: list[Sequence], pool: KVPool, max_model_len: int,
               cached: Sequence_[int] = ()) -> bool:
        """Whether to admit `seq` now, beyond its reservation fitting in the pool (the `predicted`
        policy checks the predicted future KV peak of the running set). `cached`: the cached pages
        `seq` would attach."""
        ...

    def pick_victim(self, running: list[Sequence]) -> Sequence:
        """The request to preempt (by recompute) when a running one cannot grow."""
        ...

    def on_finish(self, seq: Sequence) -> None:
        """Learn from a finished request (its natural output length)."""
        ...


class OptimisticPolicy:
    """vLLM: admit when the tokens to prefill fit; grow as you go; preempt the newest on exhaustion."""

    name = "optimistic"

    def reservation_tokens(self, seq: Sequence, max_model_len: int) -> int:
        return seq.num_tokens

    def admits(self, seq: Sequence, running: list[Sequence], pool: KVPool, max_model_len: int,
               cached: Sequence_[int] = ()) -> bool:
        return True

    def pick_victim(self, running: list[Sequence]) -> Sequence:
        return running[-1]

    def on_finish(self, seq: Sequence) -> None:
        pass


class MaxPolicy(OptimisticPolicy):
    """Reserve prompt + max_tokens up front (PyTorch-style servers): never preempts, wastes most."""

    name = "max"

    def reservation_tokens(self, seq: Sequence, max_model_len: int) -> int:
        return min(seq.prompt_len + seq.params.max_tokens, max_model_len)


def make_policy(name: str, **options: Any) -> AdmissionPolicy:
    if name == "max":
        return MaxPolicy()
    if name == "optimistic":
        return OptimisticPolicy()
    if name == "predicted":
        from .predicted import PredictedPolicy

        return PredictedPolicy(**options)
    raise ValueError(f"unknown admission policy {name!r}")
