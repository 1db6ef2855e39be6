"""The scheduler under --scheduling-policy priority: waiting order, who gets a freed seat, and who is
preempted when pages run short (a real KVPool in accounting-only mode, steps driven by hand)."""

from __future__ import annotations

import pytest

from pipeserve.engine.kv.policy import OptimisticPolicy
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.scheduler import ScheduledBatch, Scheduler
from pipeserve.engine.sequence import Sequence, Status
from pipeserve.sampling_params import SamplingParams

TOKEN = 7


class Harness:
    def __init__(self, policy: str = "priority", num_pages: int = 64, max_num_seqs: int = 4) -> None:
        self.pool = KVPool.accounting_only(num_pages, 4, max_num_seqs, 64)
        self.sched = Scheduler(pool=self.pool, policy=OptimisticPolicy(), max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=64, max_model_len=64, on_admit=lambda s: None,
                               on_release=lambda s: None, scheduling_policy=policy)
        self.clock = 0.0

    def add(self, rid: str, priority: int, prompt_len: int = 4, max_tokens: int = 8) -> Sequence:
        self.clock += 1.0
        params = SamplingParams(max_tokens=max_tokens, priority=priority)
        seq = Sequence(rid, list(range(1, prompt_len + 1)), prompt_len, params, arrival=self.clock)
        self.sched.add(seq)
        return seq

    def step(self) -> tuple[ScheduledBatch, list[Sequence]]:
        batch = self.sched.schedule()
        sampled = batch.sampling()
        return batch, self.sched.postprocess(batch, sampled, [TOKEN] * len(sampled))


def names(seqs: object) -> list[str]:
    return [s.rid for s in seqs]  # type: ignore[attr-defined]


def test_waiting_queue_is_ordered_by_priority_then_arrival() -> None:
    h = Harness()
    for rid, prio in [("a", 0), ("b", 1), ("c", -1), ("d", 0), ("e", -1)]:
        h.add(rid, prio)
    assert names(h.sched.waiting) == ["c", "e", "a", "d", "b"]


def test_fcfs_ignores_priority() -> None:
    h = Harness("fcfs")
    for rid, prio in [("a", 0), ("b", 1), ("c", -1)]:
        h.add(rid, prio)
    assert names(h.sched.waiting) == ["a", "b", "c"]
    batch, _ = h.step()
    assert names(batch.prefill) == ["a", "b", "c"]


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        Harness("lifo")


def test_a_freed_seat_goes_to_the_earliest_priority() -> None:
    h = Harness(max_num_seqs=2)
    h.add("b0", 0, max_tokens=2)
    h.add("b1", 0, max_tokens=8)
    h.step()  # both seated
    h.add("b2", 0)
    h.add("late", -1)  # arrives last but outranks b2
    finished: list[str] = []
    while "b0" not in finished:
        _, done = h.step()
        finished += [s.rid for s in done]
    assert names(h.sched.running) == ["b1"]
    h.step()  # b0's seat goes to late, not to b2 that waited longer
    assert names(h.sched.running) == ["b1", "late"] and names(h.sched.waiting) == ["b2"]


def test_pages_short_preempts_the_latest_priority_running_request() -> None:
    # 6 pages of 4 tokens: three requests of 8 tokens each hold 2 pages, the pool is full.
    h = Harness(num_pages=6)
    low = h.add("low", 2, prompt_len=7, max_tokens=20)
    mid = h.add("mid", 1, prompt_len=7, max_tokens=20)
    top = h.add("top", 0, prompt_len=7, max_tokens=20)
    h.step()
    assert names(h.sched.running) == ["top", "mid", "low"]
    # Growing to a third page: someone must go, and it is the latest priority, not the one growing.
    while not h.sched.num_preemptions:
        h.step()
    assert low.status is Status.WAITING and top.status is mid.status is Status.RUNNING
    assert h.sched.preemptions_by_priority == {2: 1}
    assert names(h.sched.waiting) == ["low"] and low.num_computed == 0 and low.num_output > 0


def test_an_earlier_priority_arrival_preempts_instead_of_waiting() -> None:
    h = Harness(num_pages=4)
    low = h.add("low", 1, prompt_len=8, max_tokens=2)  # 2 pages, promised 3 with its output
    other = h.add("other", 1, prompt_len=4, max_tokens=2)
    h.step()
    assert names(h.sched.running) == ["low", "other"] and h.pool.available < 2
    urgent = h.add("urgent", 0, prompt_len=8, max_tokens=2)
    batch, _ = h.step()
    assert urgent in batch.prefill and urgent.status is Status.RUNNING
    assert Status.WAITING in (low.status, other.status)
    assert set(h.sched.preemptions_by_priority) == {1}
    # The same pool full of equal priorities: the newcomer waits.
    h2 = Harness(num_pages=4)
    h2.add("low", 0, prompt_len=8, max_tokens=2)
    h2.add("other", 0, prompt_len=4, max_tokens=2)
    h2.step()
    late = h2.add("late", 0, prompt_len=8, max_tokens=2)
    h2.step()
    assert late.status is Status.WAITING


def test_preempted_requests_finish_with_all_their_tokens() -> None:
    h = Harness(num_pages=6)
    seqs = [h.add(f"r{i}", i % 3, prompt_len=7, max_tokens=12) for i in range(5)]
    for _ in range(500):
        if not h.sched.has_work():
            break
        h.step()
    assert not h.sched.has_work() and h.sched.num_preemptions > 0
    assert all(s.num_output == 12 and s.finish_reason == "length" for s in seqs)
