"""The continuous-batching scheduler on its own: a real KVPool in accounting-only mode (pages and
promises, no K/V tensors), steps driven by hand with a fixed sampled token."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from pipeserve.engine.kv.policy import AdmissionPolicy, MaxPolicy, OptimisticPolicy
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.scheduler import ScheduledBatch, Scheduler
from pipeserve.engine.sequence import Sequence, Status
from pipeserve.sampling_params import SamplingParams

TOKEN = 7  # what every step samples; no request stops on it


class Harness:
    def __init__(
        self,
        num_pages: int = 64,
        page_size: int = 4,
        max_num_seqs: int = 4,
        max_num_batched_tokens: int = 16,
        max_model_len: int = 64,
        policy: AdmissionPolicy | None = None,
    ) -> None:
        self.pool = KVPool.accounting_only(num_pages, page_size, max_num_seqs, max_model_len)
        self.admitted: list[str] = []
        self.released: list[str] = []
        self.sampled: list[Sequence] = []  # the last step's sampling rows, in row order
        self.sched = Scheduler(
            pool=self.pool,
            policy=policy or OptimisticPolicy(),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            on_admit=lambda s: self.admitted.append(s.rid),
            on_release=lambda s: self.released.append(s.rid),
        )

    def add(self, rid: str, prompt_len: int, max_tokens: int = 16) -> Sequence:
        params = SamplingParams(max_tokens=max_tokens)
        seq = Sequence(rid, list(range(1, prompt_len + 1)), prompt_len, params, arrival=0.0)
        self.sched.add(seq)
        return seq

    def step(self) -> tuple[ScheduledBatch, list[Sequence]]:
        """One schedule + postprocess; the batch and the requests that finished."""
        batch = self.sched.schedule()
        self.sampled = batch.sampling()  # before postprocess advances the cache positions
        return batch, self.sched.postprocess(batch, self.sampled, [TOKEN] * len(self.sampled))


def rows(batch: ScheduledBatch) -> tuple[list[str], list[tuple[str, int]]]:
    """Decode rows, then (request, chunk length) of each prefill row: the flat batch's order."""
    prefill = [(s.rid, n) for s, n in zip(batch.prefill, batch.prefill_lens, strict=True)]
    return [s.rid for s in batch.decode], prefill


def rids(seqs: Seq[Sequence]) -> list[str]:
    return [s.rid for s in seqs]


def test_token_budget_is_respected_every_step() -> None:
    h = Harness(max_num_batched_tokens=16)
    for i in range(4):
        h.add(f"r{i}", prompt_len=10, max_tokens=3)
    # Step 1: r0's whole prompt, then as much of r1 as the budget leaves.
    batch, _ = h.step()
    assert rows(batch) == ([], [("r0", 10), ("r1", 6)]) and batch.num_tokens == 16
    # Step 2: r0 decodes, r1 finishes its prompt, r2 gets the 11 left but needs 10, r3 the last 1.
    batch, _ = h.step()
    assert rows(batch) == (["r0"], [("r1", 4), ("r2", 10), ("r3", 1)]) and batch.num_tokens == 16
    while h.sched.has_work():
        batch, _ = h.step()
        assert 0 < batch.num_tokens <= 16


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end() -> None:
    h = Harness(max_num_batched_tokens=16)
    seq = h.add("long", prompt_len=40, max_tokens=2)
    for chunk, computed in ((16, 16), (16, 32)):
        batch, _ = h.step()
        assert rows(batch) == ([], [("long", chunk)]) and h.sampled == []  # only fills the cache
        assert seq.num_computed == computed and seq.num_output == 0
    batch, _ = h.step()
    assert rows(batch) == ([], [("long", 8)]) and h.sampled == [seq]  # the last chunk samples
    assert seq.num_computed == 40 and seq.output_ids == [TOKEN]
    batch, finished = h.step()
    assert rows(batch) == (["long"], []) and finished == [seq] and seq.finish_reason == "length"
    assert h.pool.num_free == h.pool.num_pages and h.released == ["long"]


def test_admission_is_first_come_first_served_even_when_a_later_one_would_fit() -> None:
    # 8 pages of 4 tokens; `max` reserves prompt + max_tokens at admission.
    h = Harness(num_pages=8, max_num_batched_tokens=32, policy=MaxPolicy())
    h.add("first", prompt_len=4, max_tokens=12)  # 16 tokens: 4 pages
    h.add("big", prompt_len=20, max_tokens=4)  # 24 tokens: 6 pages, more than the 4 left
    h.add("small", prompt_len=2, max_tokens=2)  # 1 page: would fit, but waits behind "big"
    batch, _ = h.step()
    assert rows(batch) == ([], [("first", 4)]) and rids(h.sched.waiting) == ["big", "small"]
    while "first" in rids(h.sched.running):
        batch, _ = h.step()
        assert "small" not in rids(batch.prefill)
    batch, _ = h.step()  # "first" finished and gave its pages back: both in arrival order
    assert rows(batch) == ([], [("big", 20), ("small", 2)])
    assert h.admitted == ["first", "big", "small"]


def test_decode_rows_come_before_prefill_rows() -> None:
    h = Harness(max_num_batched_tokens=20)
    a, b = h.add("a", prompt_len=12), h.add("b", prompt_len=30)
    h.step()  # a: 12, b: the first 8
    c = h.add("c", prompt_len=3)
    batch, _ = h.step()
    # a decodes; b continues with the 19 tokens the budget leaves after a's row; c waits for budget.
    assert rows(batch) == (["a"], [("b", 19)])
    assert h.sampled == [a]  # b's chunk does not reach its end
    batch, _ = h.step()
    assert rows(batch) == (["a"], [("b", 3), ("c", 3)])
    assert h.sampled == [a, b, c]  # decode rows first, then prefills that complete
    batch, _ = h.step()
    assert rows(batch) == (["a", "b", "c"], [])


def test_preemption_takes_the_newest_request_and_it_recomputes_later() -> None:
    # 4 pages of 4 tokens; three 4-token prompts fill 3 of them.
    h = Harness(num_pages=4, page_size=4, max_num_seqs=4, policy=OptimisticPolicy())
    a, b, c = h.add("a", 4, max_tokens=3), h.add("b", 4, max_tokens=8), h.add("c", 4, max_tokens=8)
    batch, _ = h.step()
    assert rows(batch) == ([], [("a", 4), ("b", 4), ("c", 4)]) and h.pool.num_free == 1
    # Every one now needs a second page for its 5th token: a takes the last, b preempts c (the
    # newest), and nothing is admitted in a step that had to preempt.
    batch, _ = h.step()
    assert rows(batch) == (["a", "b"], [])
    assert c.status is Status.WAITING and c.num_computed == 0 and c.pages == [] and c.slot == -1
    assert c.token_ids == [1, 2, 3, 4, TOKEN]  # its generated token is kept
    assert (c.num_preemptions, h.sched.num_preemptions) == (1, 1) and h.released == ["c"]
    assert rids(h.sched.waiting) == ["c"]  # back at the head of the queue
    # a finishes (max_tokens 3); its pages let c back in: its prompt and its token are recomputed.
    batch, finished = h.step()
    assert rows(batch) == (["a", "b"], []) and finished == [a]
    batch, _ = h.step()
    assert rows(batch) == (["b"], [("c", 5)]) and h.sampled == [b, c]
    assert c.num_output == 2 and c.status is Status.RUNNING


def test_the_newest_request_preempts_itself_rather_than_an_older_one() -> None:
    h = Harness(num_pages=3, page_size=4, policy=OptimisticPolicy())
    a, b = h.add("a", 4), h.add("b", 4)
    h.step()  # one page each, one left
    batch, _ = h.step()  # a takes the last page for its 5th token; b has no newer one to preempt
    assert rows(batch) == (["a"], []) and b.status is Status.WAITING and b.num_preemptions == 1
    assert a.num_preemptions == 0 and len(a.pages) == 2


def test_a_request_whose_next_token_cannot_fit_in_the_whole_pool_finishes_with_length() -> None:
    h = Harness(num_pages=2, page_size=4, policy=OptimisticPolicy())
    seq = h.add("a", 4, max_tokens=16)
    finished: list[Sequence] = []
    while not finished:
        _, finished = h.step()
    assert finished == [seq] and seq.finish_reason == "length" and seq.num_tokens == 8  # 2 pages of 4
    assert seq.num_preemptions == 0 and h.pool.num_free == 2


def test_max_num_seqs_caps_the_running_set_and_slots_are_reused() -> None:
    h = Harness(max_num_seqs=2, max_num_batched_tokens=64)
    for i, max_tokens in enumerate((1, 4, 4)):
        h.add(f"r{i}", prompt_len=2, max_tokens=max_tokens)
    batch, finished = h.step()
    assert rows(batch) == ([], [("r0", 2), ("r1", 2)]) and rids(h.sched.waiting) == ["r2"]
    assert rids(finished) == ["r0"]  # max_tokens 1: done at its first token, its slot (0) is free
    batch, _ = h.step()
    assert rows(batch) == (["r1"], [("r2", 2)])
    assert [(s.rid, s.slot) for s in h.sched.running] == [("r1", 1), ("r2", 0)]
