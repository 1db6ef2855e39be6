"""Continuous batching: every step is one merge step of decode rows (one token per running request)
and prefill chunks (new or partially prefilled requests), under a token budget and a request cap.
Admission through the admission policy, in arrival order (fcfs) or by (priority, arrival) (priority:
lower runs sooner); preemption by recompute when the pool runs dry, under priority of the running
requests that come latest in that order, also to admit a waiting request of an earlier priority. With
prefix caching a request is admitted on the longest run of cached pages that starts its tokens, and
its prefill starts at the first token they do not hold; the pages a step fills are findable from
that step on (the model writes every row's K/V before any attention reads the cache, so a request
admitted later in the same step shares them)."""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pipeserve.engine.kv.policy import AdmissionPolicy
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.sequence import PENDING, Sequence, Status
from pipeserve.lora import LoRARequest


class AdapterSlots(Protocol):
    """The LoRA slot table's holders (pipeserve/engine/lora/manager.py), as the scheduler asks it."""

    def can_run(self, request: LoRARequest | None) -> bool: ...

    def acquire(self, request: LoRARequest | None, request_slot: int) -> None: ...

    def release(self, request: LoRARequest | None, request_slot: int) -> None: ...


def priority_key(seq: Sequence) -> tuple[int, float]:
    """Order under the priority policy: lower priority value first, then arrival."""
    return seq.params.priority, seq.arrival


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)  # one row each, first in the flat batch
    prefill: list[Sequence] = field(default_factory=list)
    prefill_lens: list[int] = field(default_factory=list)  # chunk length of each prefill request
    # Speculative verification: decoding requests whose row is their newest token followed by
    # proposed tokens (a chunk of 1 + len(proposal) against their cache), placed before the prefills.
    verify: list[Sequence] = field(default_factory=list)
    proposals: list[list[int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(self.prefill_lens) + sum(1 + len(p) for p in self.proposals)

    def sampling(self) -> list[Sequence]:
        """Requests that sample this step, in row order: every decode row and each prefill whose
        chunk reaches the end of its tokens (a partial chunk only fills the cache)."""
        done = [
            s
            for s, n in zip(self.prefill, self.prefill_lens, strict=True)
            if s.num_computed + n == s.num_tokens
        ]
        return self.decode + self.verify + done


class Scheduler:
    def __init__(
        self,
        *,
        pool: KVPool,
        policy: AdmissionPolicy,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        on_admit: Callable[[Sequence], None],
        on_release: Callable[[Sequence], None],
        scheduling_policy: str = "fcfs",
        adapters: AdapterSlots | None = None,
    ):
        """adapters: with LoRA, a request is admitted only when its adapter has a slot; those whose
        adapter finds none wait, and the requests behind them are admitted meanwhile."""
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {scheduling_policy!r}")
        self.by_priority = scheduling_policy == "priority"
        self.pool, self.policy = pool, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.on_admit, self.on_release = on_admit, on_release  # the runner's per-slot state
        self.adapters = adapters
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.preemptions_by_priority: Counter[int] = Counter()  # the preempted request's priority
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_cache_hits = 0  # of those, tokens found

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            self._enqueue(seq)
        else:
            self.waiting.append(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Priority policy: insert in (priority, arrival) order, after its equals."""
        self.waiting.insert(bisect.bisect_right(self.waiting, priority_key(seq), key=priority_key), seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self, proposals: dict[Sequence, list[int]] | None = None) -> ScheduledBatch:
        """proposals: speculative tokens of decoding requests, verified this step (as many as the
        token budget and the pool have room for: they are cut before anything is preempted). A
        request in proposals verifies even with none left (a sampled draft decides its token so)."""
        batch = ScheduledBatch()
        proposals = proposals or {}
        budget = self.max_num_batched_tokens
        preempted = False
        if self.by_priority:
            # Running requests in priority order, so the ones after a request are those it may preempt.
            self.running.sort(key=priority_key)
        # Pages held back for the waiting head from the running requests' growth this step.
        held = self._make_room() if self.by_priority else 0
        self.pool.promised += held
        # Running requests in admission (fcfs) or priority order: decode rows, then chunks of
        # unfinished prefills.
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            n = seq.num_uncomputed
            verifying = n == 1 and seq in proposals and not seq.embed
            proposal = proposals[seq][: budget - 1] if verifying else []
            chunk = 1 + len(proposal) if n == 1 else min(n, budget)
            while not self.pool.grow(seq, seq.num_computed + chunk):
                if proposal:  # speculation never costs another request its pages
                    proposal, chunk = [], 1
                    continue
                preempted = True
                later = self.running[self.running.index(seq) + 1 :]
                victim = self.policy.pick_victim(later) if later else seq
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            if verifying:
                batch.verify.append(seq)
                batch.proposals.append(proposal)
            elif n == 1 and not seq.embed:  # an embedding's last prompt token is a chunk: it is pooled
                batch.decode.append(seq)
            else:
                batch.prefill.append(seq)
                batch.prefill_lens.append(chunk)
            if self.pool.prefix_caching:  # only real tokens: a proposal's page is never published
                self.pool.commit(seq, seq.num_computed + min(chunk, n))
            budget -= chunk
        self.pool.promised -= held
        # New requests in queue order (the head blocks those behind it); none in a step that had to
        # preempt, but the head pages were held for.
        seats = self.max_num_seqs
        no_slot: list[Sequence] = []  # waiting for a LoRA slot: passed over this step
        while self.waiting and budget > 0 and (held or not preempted) and len(self.running) < seats:
            held = 0
            seq = self.waiting[0]
            if self.adapters is not None and not self.adapters.can_run(seq.lora):
                no_slot.append(self.waiting.popleft())
                continue
            need = min(
                self.pool.pages_for(self.policy.reservation_tokens(seq, self.max_model_len)),
                self.pool.num_pages,
            )
            root = b""
            cached: list[int] = []
            hashes: list[bytes] = []
            if self.pool.prefix_caching:  # its first chunk, were it computed cold, is the budget's
                root = self.pool.root(seq, min(seq.num_tokens, budget))
                if not seq.runs_every_prompt_row:
                    cached, hashes = self.pool.match(seq, root)
            if self.pool.cost(cached, need) > self.pool.available or not self.policy.admits(
                seq, self.running, self.pool, self.max_model_len, cached
            ):
                break
            self.waiting.popleft()
            seq.slot = self._free_slots.pop()
            seq.status = Status.RUNNING
            if self.adapters is not None:
                self.adapters.acquire(seq.lora, seq.slot)
            if self.pool.prefix_caching:
                self.pool.attach(seq, root, cached, hashes)
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += seq.num_computed
                if seq.num_output == 0:
                    seq.num_cached_tokens = seq.num_computed
            self.pool.reserve(seq, need)
            self.running.append(seq)
            self.on_admit(seq)
            chunk = min(seq.num_uncomputed, budget)
            if not self.pool.grow(seq, seq.num_computed + chunk):  # beyond a capped reservation
                self.preempt(seq)
                break
            batch.prefill.append(seq)
            batch.prefill_lens.append(chunk)
            if self.pool.prefix_caching:
                self.pool.commit(seq, seq.num_computed + chunk)
            budget -= chunk
        self.waiting.extendleft(reversed(no_slot))  # their places in the queue, in order
        return batch

    def _make_room(self) -> int:
        """Priority policy: when the waiting head outranks a running request, preempt running requests
        of a later priority (the latest first) until the pool has the pages that admit it, before
        anything is scheduled. Returns the pages to hold for it (0: it does not outrank anyone)."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return 0
        head = self.waiting[0]
        if not self.running or self.running[-1].params.priority <= head.params.priority:
            return 0
        need = min(self.pool.pages_for(self.policy.reservation_tokens(head, self.max_model_len)),
                   self.pool.num_pages)
        while (
            self.running
            and self.running[-1].params.priority > head.params.priority
            and (need > self.pool.available
                 or not self.policy.admits(head, self.running, self.pool, self.max_model_len, []))
        ):
            self.preempt(self.running[-1])
        return need if need <= self.pool.available else 0

    def postprocess(
        self,
        batch: ScheduledBatch,
        sampled: list[Sequence],
        tokens: list[int],
        accepted: list[list[int]] | None = None,
    ) -> list[Sequence]:
        """Advance the cache positions, append sampled tokens and finish requests that stop.
        accepted: per sampled request, the proposals verification kept, emitted before its sampled
        token (a stop or max_tokens inside them ends the request there). Returns the requests that
        finished."""
        self.advance(batch)
        finished = []
        verifying = set(batch.verify)
        for i, (seq, token) in enumerate(zip(sampled, tokens, strict=True)):
            if seq.embed:  # its prompt is computed and its vector read out: done, nothing sampled
                self.finish(seq, "stop")
                finished.append(seq)
                continue
            kept = accepted[i] if accepted else []
            if seq in verifying:
                # Its newest token and the kept proposals have their K/V; the rest are overwritten
                # later, and the pages past them go back to the request's promise.
                seq.num_computed += 1 + len(kept)
                self.pool.shrink(seq, seq.num_computed)
            for tok in (*kept, token):
                seq.token_ids.append(tok)
                reason = self._stop_reason(seq, tok)
                if reason:
                    self.finish(seq, reason)
                    finished.append(seq)
                    break
        return finished

    def advance(self, batch: ScheduledBatch) -> None:
        """The step's rows are in the cache: advance the requests' computed counts."""
        for seq in batch.decode:
            seq.num_computed += 1
        for seq, n in zip(batch.prefill, batch.prefill_lens, strict=True):
            seq.num_computed += n

    def defer(self, batch: ScheduledBatch, sampled: list[Sequence]) -> None:
        """An overlapped step is launched and its tokens are not read yet: advance the computed counts
        and give each sampling request a PENDING token, so that the next step schedules its row (whose
        input id is taken from the device) before `land` writes the token in."""
        self.advance(batch)
        for seq in sampled:
            if seq.status is Status.RUNNING:
                seq.token_ids.append(PENDING)

    def land(self, sampled: list[Sequence],
             tokens: list[int]) -> tuple[list[Sequence], list[int], list[Sequence]]:
        """The tokens of a deferred step, read back: each request's PENDING token takes its value and
        the request stops there if it must. A request that ended meanwhile (aborted) drops its row.
        Returns the requests that got their token, with their rows in the step, and those that
        finished."""
        landed, rows, finished = [], [], []
        for row, (seq, token) in enumerate(zip(sampled, tokens, strict=True)):
            if not seq.token_ids or seq.token_ids[-1] != PENDING:  # no token was deferred for it
                continue
            if seq.status is Status.FINISHED:
                seq.token_ids.pop()
                continue
            seq.token_ids[-1] = token  # running, or preempted by the step scheduled meanwhile
            landed.append(seq)
            rows.append(row)
            reason = self._stop_reason(seq, token)
            if reason:
                self.finish(seq, reason)
                finished.append(seq)
        return landed, rows, finished

    def _stop_reason(self, seq: Sequence, token: int) -> str:
        if token in seq.stop_ids and seq.num_output > seq.params.min_tokens:  # sampler masks them before
            return "stop"
        if seq.num_output >= seq.params.max_tokens:
            return "length"
        # The next token must fit in the context and in the whole pool, or it could never run.
        if (
            seq.num_tokens >= self.max_model_len
            or self.pool.pages_for(seq.num_tokens + 1) > self.pool.num_pages
        ):
            return "length"
        return ""

    # -- leaving the running set ------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq)
        self.on_release(seq)
        if self.adapters is not None:
            self.adapters.release(seq.lora, seq.slot)
        self._free_slots.append(seq.slot)
        seq.slot = -1
        self.running.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the cache, keep the tokens, go back to the head of the queue (under
        priority: to its place in (priority, arrival) order)."""
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_priority[seq.params.priority] += 1
        if self.by_priority:
            self._enqueue(seq)
        else:
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.RUNNING:
            self._release(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.policy.on_finish(seq)
