"""Speculative decoding through the engine: greedy outputs token-identical with and without it (n-gram
and draft model, every architecture the parity tests cover, mixed batches with chunked prefills,
preemption, stop tokens and strings, max_tokens), seeded sampling reproducible and, with n-gram
proposals, independent of the batch; the proposer, the adaptive rule, page rollback and the wire's
one-token rows."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pipeserve.engine import LLM, SamplingParams
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.process import step_output
from pipeserve.engine.sequence import Sequence, Status, StepUpdate, one_token_updates
from pipeserve.engine.spec.acceptance import accept_matching
from pipeserve.engine.spec.adaptive import REFIT, AdaptiveK
from pipeserve.engine.spec.ngram import NgramProposer
from pipeserve.engine.spec.speculator import Speculator
from pipeserve.messages import unpack_ids
from tests.conftest import TEST_DEVICE

# Repetitive prompts, so n-gram lookup finds matches in random models too (whose greedy outputs loop).
PROMPTS = [
    [5, 17, 99, 3, 42, 5, 17, 99, 3, 42, 5, 17],
    [7, 8, 9, 7, 8, 9, 7],
    [300, 2, 41],
    list(range(10, 40)),
]
CHUNKED = dict(page_size=4, max_num_batched_tokens=16)  # prompts split into chunks beside decode rows


def run(model: str, prompts: list[list[int]], params: SamplingParams, **options) -> tuple[list, dict]:
    llm = LLM(model, device=TEST_DEVICE, dtype="float32", **options)
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert stats["pages_used"] == 0 and stats["pages_reserved"] == 0  # rollback kept the pool whole
    return outs, stats


def greedy(model: str, prompts: list[list[int]], max_tokens: int = 12, **options) -> tuple[list, dict]:
    outs, stats = run(model, prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                      **options)
    return [o.token_ids for o in outs], stats


def spec(method: str, model: str, draft: str | None = None) -> dict:
    """Options that speculate at every step: the adaptive rule, which depends on timings, could
    otherwise leave a test with nothing verified."""
    if method == "ngram":  # 1-gram lookups: random models' outputs repeat single tokens more often
        return dict(speculative_method="ngram", prompt_lookup_min=1, speculative_adaptive=False)
    return dict(speculative_method="draft", draft_model=draft or model, speculative_adaptive=False)


ARCHS = [
    pytest.param("llama", {}, id="llama-gqa"),
    pytest.param("llama", dict(num_key_value_heads=1), id="llama-mqa", marks=pytest.mark.slow),
    pytest.param("llama", dict(tie_word_embeddings=True, num_key_value_heads=4), id="llama-tied",
                 marks=pytest.mark.slow),
    pytest.param("qwen2", {}, id="qwen2-bias", marks=pytest.mark.slow),
    pytest.param("mistral", dict(sliding_window=6), id="mistral-window", marks=pytest.mark.slow),
    pytest.param("mixtral", {}, id="mixtral", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", {}, id="qwen2-moe", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", {}, id="qwen3-moe", marks=pytest.mark.slow),
]


@pytest.mark.device
@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("kind,overrides", ARCHS)
def test_greedy_identical_on_every_architecture(tiny_model, kind, overrides, method):
    model = tiny_model(kind, **overrides)
    # Dense models run the executor users get here (native); experts would compile Inductor per test.
    experts = kind in ("mixtral", "qwen2_moe", "qwen3_moe")
    options = dict(CHUNKED, step_executor="eager" if experts else "auto")
    want, _ = greedy(model, PROMPTS, **options)
    got, stats = greedy(model, PROMPTS, **options, **spec(method, model))
    assert got == want
    # A random model copies from its prompt only by chance; its own weights as the draft always agree.
    assert stats["spec_draft_tokens"] > 0 and (method == "ngram" or stats["spec_accepted_tokens"] > 0)


@pytest.mark.device
@pytest.mark.slow
def test_a_bad_draft_changes_speed_not_tokens(tiny_model):
    model, other = tiny_model("llama"), tiny_model("llama", seed=5)
    want, _ = greedy(model, PROMPTS, **CHUNKED)
    got, bad = greedy(model, PROMPTS, **CHUNKED, **spec("draft", model, other))
    _, good = greedy(model, PROMPTS, **CHUNKED, **spec("draft", model))
    assert got == want
    assert bad["spec_draft_tokens"] > 0
    bad_rate = bad["spec_accepted_tokens"] / bad["spec_draft_tokens"]
    assert bad_rate < 0.5 < good["spec_accepted_tokens"] / good["spec_draft_tokens"]


@pytest.fixture(scope="module")
def stories(stories_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    text = "Lily and Tom went to the park. They saw a big dog. The dog was happy. Lily and Tom went to"
    prompts = [tok(p).input_ids for p in (text, "Once upon a time", "The cat sat on the mat and", "One day",
                                          "Tim had a red car. He")]
    return stories_dir, prompts


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stories_under_preemption(stories, method):
    model, prompts = stories
    # 14 pages of 4 tokens cannot hold five ~35-token requests at once: the engine must preempt.
    small = dict(page_size=4, num_pages=14, max_num_batched_tokens=24)
    want, _ = greedy(model, prompts, 24, **small)
    got, stats = greedy(model, prompts, 24, **small, **spec(method, model))
    assert got == want
    assert stats["preemptions"] > 0 and stats["spec_accepted_tokens"] > 0


@pytest.mark.device
@pytest.mark.parametrize("method", ["ngram", pytest.param("draft", marks=pytest.mark.slow)])
def test_stops_and_max_tokens_inside_an_accepted_run(stories, method):
    model, prompts = stories
    plain = LLM(model, device=TEST_DEVICE, dtype="float32")
    fast = LLM(model, device=TEST_DEVICE, dtype="float32", **spec(method, model))
    prompt = prompts[:1]
    base = plain.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0))[0]
    # A stop token met inside a run of kept proposals ends the request there.
    stop_at = base.token_ids[9]
    first = base.token_ids.index(stop_at)
    got = fast.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_at]))[0]
    assert got.token_ids == base.token_ids[: first + 1] and got.finish_reason == "stop"
    # So does a stop string (the text ends before it, the tokens at the one that completed it).
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=[base.text[len(base.text) // 2 :][:6]])
    want, got = plain.generate(prompt, params)[0], fast.generate(prompt, params)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    for max_tokens in (1, 2, 5, 7):
        got = fast.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
        assert got.token_ids == base.token_ids[:max_tokens]
    stats = fast.engine.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["pages_used"] == 0


@pytest.mark.device
@pytest.mark.slow
def test_seeded_sampling_with_ngram_is_the_plain_stream_in_any_batch(stories):
    model, prompts = stories
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=11)
    plain, _ = run(model, prompts, params)
    llm = LLM(model, device=TEST_DEVICE, dtype="float32", **spec("ngram", model))
    together, alone = llm.generate(prompts, params), llm.generate(prompts[:1], params)
    assert [o.token_ids for o in together] == [o.token_ids for o in plain]
    assert alone[0].token_ids == plain[0].token_ids
    assert llm.engine.stats()["spec_accepted_tokens"] > 0
    adaptive, _ = run(model, prompts, params, speculative_method="ngram")  # whatever sizes the rule picks
    assert [o.token_ids for o in adaptive] == [o.token_ids for o in plain]


@pytest.mark.device
@pytest.mark.slow
def test_seeded_sampling_with_a_draft_is_reproducible(stories):
    model, prompts = stories
    # Sampled requests beside greedy ones: the greedy ones are plain greedy decoding.
    params = [SamplingParams(max_tokens=20, temperature=0.0 if i % 2 else 0.8, seed=11)
              for i in range(len(prompts))]
    llm = LLM(model, device=TEST_DEVICE, dtype="float32", **spec("draft", model))
    first, second = llm.generate(prompts, params), llm.generate(prompts, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert llm.engine.stats()["spec_accepted_tokens"] > 0
    plain, _ = run(model, prompts[1::2], SamplingParams(max_tokens=20, temperature=0.0))
    assert [o.token_ids for o in first[1::2]] == [o.token_ids for o in plain]


@pytest.mark.device
@pytest.mark.slow
def test_opt_out_and_logprob_requests_decode_beside_speculating_ones(stories):
    model, prompts = stories
    llm = LLM(model, device=TEST_DEVICE, dtype="float32", **spec("ngram", model))
    llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, speculative=False))
    assert llm.engine.stats()["spec_verifications"] == 0
    # A request asking for logprobs decodes one token a step beside one that verifies proposals.
    requests = [(prompts[0], SamplingParams(max_tokens=16, temperature=0.0)),
                (prompts[1], SamplingParams(max_tokens=16, temperature=0.0, logprobs=3))]
    plain = LLM(model, device=TEST_DEVICE, dtype="float32")
    want = plain.generate([p for p, _ in requests], [s for _, s in requests])
    got = llm.generate([p for p, _ in requests], [s for _, s in requests])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got[1].logprobs, want[1].logprobs, strict=True):
        assert list(g["top"]) == list(w["top"]) and g["logprob"] == pytest.approx(w["logprob"], abs=1e-5)
    assert llm.engine.stats()["spec_accepted_tokens"] > 0


@pytest.mark.slow
def test_triton_kernels_verify_multi_token_rows(tiny_model):
    """Verification rows are chunks against the cache: the Triton prefill kernel serves them (here
    under the interpreter), with no kernel of their own."""
    model = tiny_model("llama")
    want, _ = greedy(model, PROMPTS[:2], 6, backend="cpu", page_size=4)
    for method in ("ngram", "draft"):
        got, stats = greedy(model, PROMPTS[:2], 6, backend="triton", page_size=4, **spec(method, model))
        assert got == want and stats["spec_accepted_tokens"] > 0


# -- the pieces ---------------------------------------------------------------------------------
def test_ngram_proposes_after_the_latest_longest_match():
    proposer = NgramProposer(1, 3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]  # latest 3-gram
    assert proposer.propose([4, 1, 2, 8, 1, 2], 3) == [8, 1, 2]
    assert proposer.propose([4, 5, 6], 3) == []
    assert NgramProposer(2, 3).propose([1, 5, 2, 1], 2) == []  # a 1-gram match is below the minimum
    assert proposer.propose([3, 3], 4) == [3]  # never past the sequence


def test_ngram_matches_a_brute_force_search():
    def brute(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tokens[len(tokens) - n :]:
                    return tokens[start + n : start + n + k]
        return []

    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, rng.integers(1, 30)).tolist()
        lo = int(rng.integers(1, 3))
        hi = lo + int(rng.integers(0, 3))
        assert NgramProposer(lo, hi).propose(tokens, 3) == brute(tokens, lo, hi, 3), (tokens, lo, hi)


def test_accept_matching_counts_the_leading_run():
    targets = np.array([[1, 2, 3, 4], [1, 9, 3, 4], [5, 2, 3, 4]])
    proposals = np.array([[1, 2, 3], [1, 2, 3], [1, 2, -1]])
    assert accept_matching(targets, proposals, np.array([3, 3, 2])).tolist() == [3, 1, 0]
    assert accept_matching(targets[:1], proposals[:1], np.array([2])).tolist() == [2]


def test_adaptive_rule_stops_at_large_batch_and_for_poor_acceptance():
    rule = AdaptiveK(4, 8)
    slots = np.arange(2)
    assert rule.sizes(slots, 1).tolist() == [4, 4]  # nothing measured yet: try
    for tokens in range(1, 41):  # 1 ms fixed + 0.1 ms per token (+ 0.3 ms per verifying request)
        verifying = tokens % 3
        rule.record_step(tokens, verifying, 1e-3 + 1e-4 * tokens + 3e-4 * verifying)
    a, b, c = rule.cost.fit or (0, 0, 0)
    assert (a, b, c) == pytest.approx((1e-3, 1e-4, 3e-4), rel=1e-3)
    rule.observe(slots, np.array([4, 4]), np.array([4, 0]))
    small = rule.sizes(slots, 1)
    assert small[0] == 4 and small[1] < small[0]
    assert rule.sizes(slots, 1000).tolist() == [0, 0]  # compute-bound: w near 1
    # A verification costing about a step (1 ms a request) pays for a well-accepted request only.
    for _ in range(200):
        rule.record_step(1, 0, 1.1e-3)
        rule.record_step(3, 1, 1.3e-3 + 1e-3)
    rule.observe(slots, np.array([1, 1]), np.array([1, 0]))
    assert rule.sizes(slots, 1).tolist() == [4, 0]
    assert not rule.off(1)
    for _ in range(200):  # at 5 ms, for neither
        rule.record_step(1, 0, 1.1e-3)
        rule.record_step(3, 1, 1.3e-3 + 5e-3)
    assert rule.sizes(slots, 1).tolist() == [0, 0] and rule.off(1)
    rule.adaptive = False  # --no-speculative-adaptive: always the configured size
    assert rule.sizes(slots, 1000).tolist() == [4, 4]


def measured_rule(costs: dict[int, float], alpha: float) -> AdaptiveK:
    """A rule costing steps of up to 8 rows per row count (compiled steps), each count measured 8
    times (its first measurement is left out), its one request keeping proposals at rate alpha."""
    rule = AdaptiveK(4, 8, exact_rows=8)
    for _ in range(8):
        for rows, seconds in costs.items():
            rule.record_step(rows, int(rows > 1), seconds)
            rule.record_rows(rows, seconds)
    rule.kept[0], rule.trials[0] = 1000 * alpha, 1000
    return rule


def test_adaptive_rule_sizes_compiled_steps_by_their_row_counts():
    one = np.array([0])
    # Products of 1-3 rows cost alike, of 4 or more twice as much (the CPU's small-batch GEMMs).
    cliff = {1: 1.0e-3, 2: 1.02e-3, 3: 1.05e-3, 4: 2.0e-3, 5: 2.05e-3}
    assert measured_rule(cliff, 0.95).sizes(one, 1).tolist() == [2]
    # The linear fit through the same steps would rather propose 4.
    assert AdaptiveK(4, 8).sizes(one, 1).tolist() == [4]
    flat = {1: 1.0e-3, 2: 1.02e-3, 3: 1.05e-3, 4: 1.07e-3, 5: 1.1e-3}
    assert measured_rule(flat, 0.95).sizes(one, 1).tolist() == [4]
    # Poor acceptance: verifying never pays.
    assert measured_rule(cliff, 0.02).sizes(one, 1).tolist() == [0]
    # Lookups that rarely find anything: each miss costs its lookup and gains nothing.
    rare = measured_rule(flat, 0.95)
    rare.record_lookups(one, np.array([False]), 0, 0.3e-3)
    assert rare.hits[0] / rare.asks[0] < 1 and rare.miss_seconds > 0
    rare.hits[0], rare.miss_seconds = 0.05 * rare.asks[0], 0.3e-3
    assert rare.sizes(one, 1).tolist() == [0]
    rare.hits[0] = 0.5 * rare.asks[0]
    rare.steps += REFIT  # a later step decides again
    assert rare.sizes(one, 1).tolist() == [4]
    # Row counts not measured yet cost at least the largest smaller one measured: the most
    # promising of them is tried.
    assert measured_rule({1: 1e-3, 5: 2.05e-3}, 0.95).sizes(one, 1).tolist() == [3]
    # At batch 2 only proposals whose rows fit (2 + 2 * 3 = 8) are costed per row count.
    two = np.array([0, 1])
    wide = measured_rule({n: 1e-3 for n in range(1, 9)}, 0.95)
    wide.kept[1], wide.trials[1] = 950, 1000
    assert wide.sizes(two, 2).tolist() == [3, 3]


def test_adaptive_rule_rests_where_nothing_pays():
    from pipeserve.engine.spec.adaptive import HOLD

    rule = measured_rule({1: 1.0e-3, 2: 3e-3, 3: 3e-3, 4: 3e-3, 5: 3e-3}, 0.3)
    before = rule.alpha(np.array([0]))[0]
    rule.rest(np.array([0]), 1)
    assert rule.alpha(np.array([0]))[0] > before  # drifted toward the prior at once
    assert all(rule.rests(1) for _ in range(HOLD - 1))  # no look at the costs meanwhile
    assert not rule.rests(1)  # then sizes decides again
    rule.rest(np.array([0]), 1)  # a second rest in a row is twice as long
    assert all(rule.rests(1) for _ in range(2 * HOLD - 1)) and not rule.rests(1)
    rule.record_lookups(np.array([0]), np.array([False]), 0, 1e-5)  # a lookup that found nothing
    rule.rest(np.array([0]), 1)  # the rests keep growing
    assert all(rule.rests(1) for _ in range(4 * HOLD - 1)) and not rule.rests(1)
    rule.observe(np.array([0]), np.array([2]), np.array([1]))  # a kept proposal: back to HOLD
    rule.rest(np.array([0]), 1)
    assert all(rule.rests(1) for _ in range(HOLD - 1)) and not rule.rests(1)
    rule.rest(np.array([0]), 1)
    assert not rule.rests(2)  # another batch size ends the rest


def test_rests_grow_past_max_hold_when_steps_are_cheap():
    """Rests double up to MAX_HOLD steps or REST_SECONDS of plain steps, whichever is longer: a
    decision's host work stays a small share of a rest of cheap steps too."""
    from pipeserve.engine.spec.adaptive import HOLD, MAX_HOLD, REST_SECONDS

    def longest(step_seconds: float) -> int:
        rule = measured_rule({1: step_seconds, 2: 3 * step_seconds}, 0.3)
        for _ in range(12):
            rule.rest(np.array([0]), 1)
        return rule.rest_steps

    assert longest(1e-3) == MAX_HOLD  # 64 steps of 1 ms: longer than REST_SECONDS
    cheap = longest(1e-4)
    assert cheap > MAX_HOLD and cheap <= REST_SECONDS / 1e-4 and cheap >= HOLD * 2**5


def test_a_rest_skips_the_proposer_entirely():
    """Inside a rest at the running batch size, propose() returns before looking at a request."""
    spec = Speculator(k=4, max_num_seqs=2, max_model_len=256, ngram=NgramProposer(1, 3), exact_rows=8)
    spec.adaptive.rest(np.array([0]), 1)
    seq = Sequence("r", [1, 2, 1, 2, 1], 5, SamplingParams(), 0.0, status=Status.RUNNING, slot=0)
    seq.num_computed = 4
    steps = spec.adaptive.steps
    assert spec.propose([seq]) == ({}, None) and spec._resting and spec.adaptive.steps == steps + 1


def test_pool_shrink_returns_pages_to_the_promise():
    pool = KVPool.accounting_only(16, 4, 2, 64)
    seq = Sequence("a", [1] * 6, 6, SamplingParams(), 0.0, status=Status.RUNNING, slot=0)
    pool.reserve(seq, 3)
    assert pool.grow(seq, 6 + 5)  # a newest token and 4 proposals past the 6 tokens
    assert len(seq.pages) == 3 and pool.promised == 0
    pool.shrink(seq, 7)
    assert len(seq.pages) == 2 and pool.promised == 1 and pool.num_free == 14
    pool.release(seq)
    assert pool.num_free == 16 and pool.promised == 0


def test_several_tokens_become_one_row_each():
    seq = Sequence("r", [1, 2], 1, SamplingParams(), 0.0)
    updates = [StepUpdate(seq, [5, 6, 7], "stop", None, True), StepUpdate(seq, [], "abort")]
    rows = one_token_updates(updates)
    assert [(u.token_ids, u.finish_reason, u.new) for u in rows] == [
        ([5], "", True), ([6], "", False), ([7], "stop", False), ([], "abort", False)]
    out = step_output(3, updates)
    assert out.rids == ["r"] * 4 and unpack_ids(out.tokens).tolist() == [5, 6, 7, -1]
    assert out.finish == ["", "", "stop", "abort"] and len(out.new) == 1


@pytest.mark.device
def test_sampler_rows_at_offsets_draw_the_later_steps():
    """A verification row at output index g + j samples exactly what plain decoding draws at step
    g + j: same noise, same min_tokens mask."""
    from pipeserve.engine.sampler import Sampler

    sampler = Sampler(2, 50, torch.device(TEST_DEVICE))
    params = SamplingParams(temperature=1.0, seed=3, min_tokens=2)
    sampler.set_request(0, params, [1], [], [4])
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0), device="cpu").to(TEST_DEVICE)
    logits[:, 4] = 10.0  # the stop id dominates once allowed
    slots = np.zeros(3, dtype=np.int64)
    rows = sampler.sample(logits, slots, torch.as_tensor(slots), offsets=(np.arange(3), torch.arange(3)))
    plain = Sampler(2, 50, torch.device(TEST_DEVICE))
    plain.set_request(0, params, [1], [], [4])
    one = np.zeros(1, dtype=np.int64)
    seq = [plain.sample(logits[i : i + 1], one, torch.as_tensor(one)).tokens.item() for i in range(3)]
    assert rows.tokens.tolist() == seq and seq[2] == 4 and 4 not in seq[:2]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_pipeserve_up_serves_speculative_outputs(stories, tmp_path):
    """Through real processes: several tokens per step reach the client as the same text, tokens,
    stop and usage as plain decoding gives, and the counters are exported."""
    import asyncio

    from pipeserve.gateway.client import AsyncClient
    from pipeserve.local_cluster import LocalCluster

    model, _ = stories
    text = "Lily and Tom went to the park. They saw a big dog. The dog was happy. Lily and Tom went to"
    requests = [dict(prompt=text, max_tokens=30, temperature=0.0),
                dict(prompt=text, max_tokens=30, temperature=0.0, stop=[" dog"]),
                dict(prompt="Once upon a time", max_tokens=20, temperature=0.7, seed=5)]
    plain = LLM(model, device="cpu")
    want = [plain.generate(r.pop("prompt"), SamplingParams(**r))[0] for r in [dict(r) for r in requests]]

    async def all_of(target: str) -> list:
        async with AsyncClient(target) as client:
            return await asyncio.gather(*(client.generate(**r) for r in requests))

    flags = ("--speculative-method", "ngram", "--prompt-lookup-min", "1", "--no-speculative-adaptive")
    with LocalCluster(tmp_path / "up.log", model, *flags, workers=1, startup=90) as srv:
        got = asyncio.run(all_of(srv.target))
        # Engine counters reach the gateway with the engine's heartbeats: wait for the next one.
        key = 'pipeserve:spec_decode_num_accepted_tokens_total{engine="0"}'
        deadline = time.monotonic() + 10
        while (metrics := srv.metrics()).get(key, 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
    for g, w in zip(got, want, strict=True):
        assert (g.text, g.token_ids, g.finish_reason) == (w.text, w.token_ids, w.finish_reason)
        assert g.completion_tokens == len(w.token_ids)
    assert metrics[key] > 0


def test_scheduler_verifies_grows_and_truncates_inside_an_accepted_run():
    """Proposals become a verification chunk; the pages grown for them shrink back to the kept
    tokens; max_tokens met inside the kept run ends the request there."""
    from pipeserve.engine.kv.policy import OptimisticPolicy
    from pipeserve.engine.scheduler import Scheduler

    pool = KVPool.accounting_only(32, 4, 2, 64)
    sched = Scheduler(pool=pool, policy=OptimisticPolicy(), max_num_seqs=2, max_num_batched_tokens=16,
                      max_model_len=64,
                      on_admit=lambda s: None, on_release=lambda s: None)
    short = Sequence("short", [1, 2, 3], 3, SamplingParams(max_tokens=3), 0.0)
    long = Sequence("long", [1, 2, 3], 3, SamplingParams(max_tokens=20), 0.0)
    for seq in (short, long):
        sched.add(seq)
    batch = sched.schedule()
    sched.postprocess(batch, batch.sampling(), [9, 9])  # prefill: 3 prompt tokens + 1 generated each
    batch = sched.schedule({short: [5, 6, 7], long: [5, 6, 7, 8, 9, 10]})
    assert batch.verify == [short, long] and batch.proposals == [[5, 6, 7], [5, 6, 7, 8, 9, 10]]
    assert batch.num_tokens == 4 + 7 and len(long.pages) == 3  # positions 3..9 need a third page
    finished = sched.postprocess(batch, batch.sampling(), [8, 11], [[5, 6, 7], [5]])
    assert finished == [short] and short.output_ids == [9, 5, 6] and short.finish_reason == "length"
    assert long.output_ids == [9, 5, 11] and long.num_computed == 5 and len(long.pages) == 2
    assert pool.num_free == 30  # the short one's pages back, the long one's third page too


@pytest.mark.device
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_prompt_logprobs_beside_speculating_requests(tiny_model, method):
    """Requests asking for prompt logprobs prefill in chunks beside ones that verify proposals: the
    prompt rows are read out of the target model only (never the draft's), tokens unchanged."""
    model = tiny_model("llama")
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, prompt_logprobs=k)
              for k in (2, None, 1, 0)]
    want = LLM(model, device=TEST_DEVICE, dtype="float32", **CHUNKED).generate(PROMPTS, params)
    llm = LLM(model, device=TEST_DEVICE, dtype="float32", **CHUNKED, **spec(method, model))
    got = llm.generate(PROMPTS, params)
    assert llm.engine.stats()["spec_verifications"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None)
        for a, b in zip(g.prompt_logprobs or [], w.prompt_logprobs or [], strict=True):
            assert (a is None and b is None) or (list(a["top"]) == list(b["top"])
                                                 and a["logprob"] == pytest.approx(b["logprob"], abs=1e-5))
