"""Prefix caching in the pool and the scheduler, without a model: an accounting-only KVPool with
prefix caching on, steps driven by hand with a fixed sampled token (tests/test_scheduler.py's
Harness), and a property test of the pool under random add / abort / finish / preempt sequences."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pipeserve.engine.kv.policy import MaxPolicy, OptimisticPolicy
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.kv.prefix import page_hash, root_hash
from pipeserve.engine.scheduler import ScheduledBatch, Scheduler
from pipeserve.engine.sequence import Sequence, Status
from pipeserve.sampling_params import SamplingParams

TOKEN = 7
PAGE = 4


class Harness:
    def __init__(self, num_pages: int = 32, max_num_seqs: int = 4, max_num_batched_tokens: int = 64,
                 max_model_len: int = 64, policy: OptimisticPolicy | None = None) -> None:
        self.pool = KVPool.accounting_only(num_pages, PAGE, max_num_seqs, max_model_len, prefix_caching=True)
        self.sched = Scheduler(pool=self.pool, policy=policy or OptimisticPolicy(), max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                               on_admit=lambda s: None, on_release=lambda s: None)

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4, salt: str = "") -> Sequence:
        seq = Sequence(rid, list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens), arrival=0.0,
                       cache_salt=salt)
        self.sched.add(seq)
        return seq

    def step(self) -> ScheduledBatch:
        batch = self.sched.schedule()
        sampled = batch.sampling()
        self.sched.postprocess(batch, sampled, [TOKEN] * len(sampled))
        return batch

    def run(self) -> None:
        while self.sched.has_work():
            self.step()


def chunks(batch: ScheduledBatch) -> dict[str, tuple[int, int]]:
    """Each prefill row: (first position, chunk length)."""
    return {s.rid: (s.num_computed - n, n) for s, n in zip(batch.prefill, batch.prefill_lens, strict=True)}


PROMPT = list(range(100, 118))  # 18 tokens: 4 full pages and 2 tokens


def test_hashes_name_salt_dtype_parent_and_tokens() -> None:
    root = root_hash("", "auto", [])
    assert len(root) == 16 and root == root_hash("", "auto", [1, 2])  # the chunk matters only for int8/fp8
    assert len({root, root_hash("a", "auto", []), root_hash("", "int8", [1]), root_hash("", "fp8", [1])}) == 4
    assert root_hash("", "int8", [1, 2]) != root_hash("", "int8", [1, 3])
    assert page_hash(root, [1, 2]) != page_hash(root_hash("a", "auto", []), [1, 2])
    assert page_hash(root, [1, 2]) != page_hash(root, [2, 1]) != page_hash(page_hash(root, [0, 0]), [2, 1])


def test_a_shared_prefix_is_attached_and_prefill_starts_at_the_first_uncached_token() -> None:
    h = Harness()
    a = h.add("a", PROMPT)
    h.run()
    assert a.num_cached_tokens == 0 and h.pool.stats().pages_cached == 5  # 4 prompt pages + 1 with output
    cached = set(h.pool._cached)
    b = h.add("b", PROMPT[:10] + [1, 2, 3])  # shares 2 full pages (8 tokens)
    batch = h.step()
    assert chunks(batch) == {"b": (8, 5)} and b.num_cached_tokens == 8 and set(b.pages[:2]) <= cached
    assert (h.sched.prefix_cache_queries, h.sched.prefix_cache_hits) == (18 + 13, 8)
    h.run()
    assert h.pool.num_free == h.pool.num_pages and h.pool.promised == 0


def test_the_last_prompt_token_is_always_computed() -> None:
    h = Harness()
    h.add("a", PROMPT[:16])
    h.run()
    b = h.add("b", PROMPT[:16])  # 4 full pages cached, but the last token needs its logits
    batch = h.step()
    assert chunks(batch) == {"b": (12, 4)} and b.num_cached_tokens == 12 and h.sched.prefix_cache_hits == 12
    assert b.num_output == 1  # the chunk ended at the prompt's end: it sampled


def test_a_request_admitted_in_the_same_step_shares_the_pages_that_step_writes() -> None:
    h = Harness()
    a, b = h.add("a", PROMPT), h.add("b", PROMPT[:12] + [1, 2])
    batch = h.step()
    assert chunks(batch) == {"a": (0, 18), "b": (12, 2)} and b.pages[:3] == a.pages[:3]
    assert b.num_cached_tokens == 12


def test_requests_share_pages_held_by_a_running_request_and_pay_only_for_new_ones() -> None:
    h = Harness(num_pages=8, policy=MaxPolicy())
    a = h.add("a", PROMPT, max_tokens=3)  # max: 21 tokens = 6 pages promised
    h.step()
    assert h.pool.available == 2
    b = h.add("b", PROMPT[:16] + [1, 2], max_tokens=2)  # 5 pages, 4 of them a's full prompt pages
    h.step()
    assert b.pages[:4] == a.pages[:4] and b.num_cached_tokens == 16
    assert h.pool.available == 1 and all(h.pool.refs[p] == 2 for p in a.pages[:4])
    h.sched.finish(b, "abort")  # an aborted sharer frees nothing a uses
    assert all(h.pool.refs[p] == 1 for p in a.pages[:4]) and a.status is Status.RUNNING
    assert not set(a.pages) & (set(h.pool._free) | set(h.pool._cached))
    h.run()
    assert h.pool.num_free == 8 and h.pool.promised == 0


def test_different_salts_never_share_and_the_same_salt_does() -> None:
    h = Harness()
    h.add("a", PROMPT, salt="tenant-1")
    h.run()
    other, same = h.add("b", PROMPT, salt="tenant-2"), h.add("c", PROMPT, salt="tenant-1")
    h.run()
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 16


def test_eviction_takes_the_least_recently_released_pages_tail_first() -> None:
    h = Harness(num_pages=8, max_num_seqs=2)
    h.add("a", PROMPT[:12], max_tokens=1)  # 3 full pages, cached when a ends
    h.run()
    assert h.pool.stats().pages_cached == 3 and len(h.pool._free) == 5
    # 5 never-hashed free pages, then a cached one: a's tail, released before its head.
    h.add("b", list(range(500, 523)), max_tokens=2)
    h.step()
    assert h.pool.stats().pages_cached == 2
    probe = Sequence("probe", PROMPT[:12] + [9], 13, SamplingParams(), arrival=0.0)
    pages, _ = h.pool.match(probe, h.pool.root(probe, 13))
    assert len(pages) == 2 and set(pages) == set(h.pool._cached)  # the head survived


def test_a_preempted_request_finds_its_own_pages_again() -> None:
    h = Harness(num_pages=6, max_num_seqs=2)
    a = h.add("a", PROMPT[:8], max_tokens=3)
    b = h.add("b", list(range(300, 316)), max_tokens=4)  # 2 + 4 pages: the pool is full
    h.step()
    h.step()  # a needs a third page: b, the newest, is preempted and a takes b's tail page
    assert b.status is Status.WAITING and b.num_preemptions == 1 and h.pool.stats().pages_cached == 3
    while b.status is Status.WAITING:
        h.step()
    assert a.status is Status.FINISHED and h.sched.prefix_cache_hits == 12  # b's 3 surviving pages
    assert b.num_cached_tokens == 0  # usage reports its first admission's
    h.run()
    assert h.pool.num_free == 6


# -- property test ---------------------------------------------------------------------------------

BASES = [list(range(10, 40)), list(range(10, 22)) + list(range(60, 78)), list(range(200, 230))]


class PoolMachine(RuleBasedStateMachine):
    """Random traffic over a small pool, with a shadow of what every page holds: the token prefix
    whose K/V each slot stores (which determines it). A page a request reads must hold exactly its
    own prefix: a shared page is what the request would have written, and no referenced page is
    ever evicted or rewritten."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(num_pages=14, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=48)
        self.ids = itertools.count()
        self.content: dict[tuple[int, int], tuple[int, ...]] = {}
        self.seqs: list[Sequence] = []

    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(1, 30), tail=st.integers(0, 6),
          max_tokens=st.integers(1, 8), salt=st.sampled_from(["", "x"]))
    def add(self, base: int, cut: int, tail: int, max_tokens: int, salt: str) -> None:
        n = next(self.ids)
        prompt = BASES[base][:cut] + [1000 + n] * tail
        self.seqs.append(self.h.add(f"r{n}", prompt, max_tokens, salt))

    @precondition(lambda self: self.h.sched.has_work())
    @rule()
    def step(self) -> None:
        pool = self.h.pool
        # Full pages some request holds are never written again unless this step evicted them (their
        # holders were preempted first); a free cached page may be evicted and reused any time.
        held = {p: h for p, h in pool.hash_of.items() if pool.refs[p] > 0}
        batch = self.h.sched.schedule()
        protected = {p for p, h in held.items() if pool.hash_of.get(p) == h}
        rows = [(s, s.num_computed, 1) for s in batch.decode]
        rows += [(s, s.num_computed, n) for s, n in zip(batch.prefill, batch.prefill_lens, strict=True)]
        for seq, start, n in rows:  # what the model writes this step
            for i in range(start, start + n):
                page = seq.pages[i // PAGE]
                assert pool.refs[page] >= 1
                assert page not in protected, "a full page in use is written again"
                self.content[(page, i % PAGE)] = tuple(seq.token_ids[: i + 1])
        sampled = batch.sampling()
        self.h.sched.postprocess(batch, sampled, [TOKEN] * len(sampled))

    @precondition(lambda self: any(s.status is not Status.FINISHED for s in self.seqs))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = [s for s in self.seqs if s.status is not Status.FINISHED]
        self.h.sched.finish(data.draw(st.sampled_from(live)), "abort")

    @precondition(lambda self: bool(self.h.sched.running))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self.h.sched.preempt(data.draw(st.sampled_from(self.h.sched.running)))

    @invariant()
    def accounting_matches_a_recount(self) -> None:
        pool, running = self.h.pool, self.h.sched.running
        refs = [0] * pool.num_pages
        for seq in running:
            for page in seq.pages:
                refs[page] += 1
        assert list(pool.refs) == refs and min(refs) >= 0
        held = {p for p, r in enumerate(refs) if r}
        free, cached = set(pool._free), set(pool._cached)
        assert len(free) == len(pool._free) and not free & cached and not (free | cached) & held
        assert len(free | cached | held) == pool.num_pages
        assert cached <= set(pool.hash_of) and not free & set(pool.hash_of)
        assert {pool.page_of[h]: h for h in pool.page_of} == pool.hash_of
        assert pool.promised == sum(s.reserved_pages - len(s.pages) for s in running) >= 0
        for seq in running:
            for i in range(seq.num_computed):
                assert self.content.get((seq.pages[i // PAGE], i % PAGE)) == tuple(seq.token_ids[: i + 1])

    def teardown(self) -> None:
        for seq in list(self.h.sched.running) + list(self.h.sched.waiting):
            self.h.sched.finish(seq, "abort")
        pool = self.h.pool
        assert pool.num_free == pool.num_pages and pool.promised == 0 and not pool.refs.any()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
