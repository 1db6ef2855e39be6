"""The `predicted` admission policy on the real Scheduler and KV pool: it never over-commits the pool,
grows past its reservation, preempts the request with the most predicted work left, falls back to
`max` without history, learns and persists; on the real engine its greedy tokens equal `max`'s and
`optimistic`'s under forced preemption."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeserve.engine.kv.policy import make_policy
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.kv.predicted import PredictedPolicy
from pipeserve.engine.kv.predictor import Features, OutputLengthPredictor
from pipeserve.engine.scheduler import Scheduler
from pipeserve.engine.sequence import Sequence, Status
from pipeserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)

EOS = 2
MAX_LEN = 1024


def make_seq(rid: str, prompt: int, app: str = "", max_tokens: int = 256, **params) -> Sequence:
    return Sequence(rid, [5] * prompt, prompt, SamplingParams(max_tokens=max_tokens, **params), 0.0, app,
                    stop_ids=frozenset({EOS}))


def trained(ranges: dict[str, range], prompt: int = 4, per_app: int = 200) -> OutputLengthPredictor:
    """A predictor that has seen `per_app` outputs spread evenly over each app's range."""
    pred = OutputLengthPredictor()
    for app, lengths in ranges.items():
        f = Features.of(make_seq("h", prompt, app))
        for i in range(per_app):
            pred.update(f, lengths[i % len(lengths)])
    return pred


def check_pool(pool: KVPool, sched: Scheduler) -> None:
    """The pool's promises are kept: nothing over-committed, every page owned once."""
    assert pool.num_free >= 0 and pool.promised >= 0 and pool.available >= 0
    allocated = pool.num_pages - pool.num_free
    assert sum(s.reserved_pages for s in sched.running) == allocated + pool.promised <= pool.num_pages
    pages = [p for s in sched.running for p in s.pages]
    assert len(pages) == len(set(pages)) == allocated
    for s in sched.running:
        assert len(s.pages) <= s.reserved_pages
        assert len(s.pages) * pool.page_size >= s.num_computed
    assert all(not s.pages and not s.reserved_pages for s in sched.waiting)


def drive(policy, seqs: list[Sequence], outputs: list[int], num_pages: int, page_size: int = 4,
          max_num_seqs: int = 8, budget: int = 64, on_step=None) -> Scheduler:
    """Run the requests to completion on an accounting-only pool; the fake model emits EOS at the
    given output length. Checks the pool after every schedule and postprocess."""
    pool = KVPool.accounting_only(num_pages, page_size, max_num_seqs, MAX_LEN)
    sched = Scheduler(pool=pool, policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      max_model_len=MAX_LEN, on_admit=lambda s: None, on_release=lambda s: None)
    target = {s: n for s, n in zip(seqs, outputs, strict=True)}
    for s in seqs:
        sched.add(s)
    for _ in range(10_000):
        if not sched.has_work():
            break
        batch = sched.schedule()
        check_pool(pool, sched)
        if on_step:
            on_step(sched)
        sampled = batch.sampling()
        sched.postprocess(batch, sampled, [EOS if s.num_output + 1 >= target[s] else 3 for s in sampled])
        check_pool(pool, sched)
    assert not sched.has_work()
    assert pool.num_free == num_pages and pool.promised == 0
    return sched


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 60), st.integers(1, 80)), min_size=1,
                         max_size=12),
       history=st.lists(st.integers(1, 60), max_size=60), num_pages=st.integers(26, 60),
       quantile=st.sampled_from([0.1, 0.5, 0.9]), mode=st.sampled_from(["peak", "reserve"]))
def test_never_over_commits_and_every_request_completes(requests, history, num_pages, quantile, mode):
    pred = OutputLengthPredictor(min_count=4)
    for n in history:
        pred.update(Features(0, "", 1, 1, "greedy"), n)  # reaches every request through the coarse keys
    seqs = [make_seq(str(i), p, max_tokens=m) for i, (p, _, m) in enumerate(requests)]
    policy = PredictedPolicy(predictor=pred, quantile=quantile, mode=mode)
    drive(policy, seqs, [o for _, o, _ in requests], num_pages)
    for s, (_, out, max_tokens) in zip(seqs, requests, strict=True):
        assert s.status is Status.FINISHED
        assert s.num_output == min(out, max_tokens)
        assert s.finish_reason == ("stop" if out <= max_tokens else "length")


def test_no_history_predicts_max_tokens():
    reserve, peak = PredictedPolicy(mode="reserve"), PredictedPolicy()
    seq = make_seq("a", 10, max_tokens=100)
    assert reserve.reservation_tokens(seq, MAX_LEN) == 110
    assert make_policy("max").reservation_tokens(seq, MAX_LEN) == 110
    assert seq.predicted_len is None
    assert reserve.reservation_tokens(make_seq("b", 1000, max_tokens=100), MAX_LEN) == MAX_LEN
    # Peak mode promises only the prompt but admits only what fits if everyone ran to max_tokens.
    assert peak.reservation_tokens(seq, MAX_LEN) == 10 and peak.final_tokens(seq, MAX_LEN) == 110
    pool = KVPool.accounting_only(40, 4, 8, MAX_LEN)  # 160 tokens
    running = [make_seq("r", 10, max_tokens=100)]
    assert peak.admits(make_seq("c", 10, max_tokens=20), running, pool, MAX_LEN)
    assert not peak.admits(make_seq("d", 10, max_tokens=100), running, pool, MAX_LEN)
    assert peak.admits(make_seq("e", 10, max_tokens=10**4), [], pool, MAX_LEN)  # alone: always


def test_predicts_the_quantile_capped_and_conditioned_on_progress():
    policy = PredictedPolicy(predictor=trained({"chat": range(1, 101)}), quantile=0.9, mode="reserve")
    seq = make_seq("a", 4, "chat", max_tokens=256)
    reserved = policy.reservation_tokens(seq, MAX_LEN)
    assert 85 <= seq.predicted_len <= 100 and reserved == 4 + seq.predicted_len
    assert policy.reservation_tokens(make_seq("b", 4, "chat", max_tokens=20), MAX_LEN) == 24  # capped
    assert policy.reservation_tokens(make_seq("c", 4, "chat", ignore_eos=True), MAX_LEN) == 4 + 256
    # Preempted after 60 tokens: the p90 of what is left, never less than what it holds.
    seq.token_ids += [3] * 60
    assert 64 + 1 <= policy.reservation_tokens(seq, MAX_LEN) <= 4 + 100
    # Beyond everything ever seen: no prediction, so `max` again.
    seq.token_ids += [3] * 60
    assert policy.reservation_tokens(seq, MAX_LEN) == 4 + 256
    # A running request that outgrows its prediction is re-predicted from where it is.
    running = make_seq("d", 4, "chat")
    assert policy.final_tokens(running, MAX_LEN) <= 4 + 100
    running.token_ids += [3] * 80
    assert 4 + 81 <= policy.final_tokens(running, MAX_LEN) <= 4 + 100


def test_peak_admission_counts_requests_that_finish_first():
    policy = PredictedPolicy(predictor=trained({"short": range(1, 9), "long": range(30, 41)}))
    running = [make_seq("a", 40, "long"), make_seq("b", 40, "short")]
    for s in running:
        policy.reservation_tokens(s, MAX_LEN)
    new = make_seq("c", 40, "short")
    policy.reservation_tokens(new, MAX_LEN)
    finals = [policy.final_tokens(s, MAX_LEN) for s in (*running, new)]
    assert finals == [79, 48, 48]  # 40-token prompts; p90s of 39 and 8 output tokens
    # Promising final sizes would need 175 tokens. Over time the peak comes when the two short ones
    # end: 3 x 48 = 144 tokens, plus up to 3 for page rounding per request: 153.
    assert policy.admits(new, running, KVPool.accounting_only(39, 4, 8, MAX_LEN), MAX_LEN)  # 156 tokens
    assert not policy.admits(new, running, KVPool.accounting_only(38, 4, 8, MAX_LEN), MAX_LEN)


@pytest.mark.parametrize("mode", ["peak", "reserve"])
def test_grows_past_its_prediction_without_preempting_when_the_pool_has_room(mode):
    policy = PredictedPolicy(predictor=trained({"chat": range(1, 9)}), quantile=0.9, mode=mode)  # 8 tokens
    seq = make_seq("a", 4, "chat")
    reserved, pages = [], []

    def watch(sched: Scheduler) -> None:
        reserved.append(seq.reserved_pages)
        pages.append(len(seq.pages))

    sched = drive(policy, [seq], [40], num_pages=64, on_step=watch)
    assert seq.num_output == 40 and sched.num_preemptions == 0
    assert reserved[0] == (3 if mode == "reserve" else 1)  # 4 + 8 tokens promised, or the prompt only
    assert max(pages) == max(reserved) == 11  # grew to 44 tokens of 4-token pages


def test_victim_is_the_most_predicted_work_left_newest_on_ties():
    apps = {"short": range(1, 9), "mid": range(5, 21), "long": range(30, 41)}
    policy = PredictedPolicy(predictor=trained(apps))
    short, long_, mid = make_seq("s", 4, "short"), make_seq("l", 4, "long"), make_seq("m", 4, "mid")
    assert policy.pick_victim([short, long_, mid]) is long_
    long_.token_ids += [3] * 34  # nearly done: ~1 token left, while `mid` has ~12
    assert policy.pick_victim([short, long_, mid]) is mid
    twin = make_seq("t", 4, "mid")
    assert policy.pick_victim([mid, twin]) is twin


def test_reserve_mode_exhaustion_preempts_the_most_predicted_work_left():
    apps = {"short": range(1, 9), "mid": range(5, 21), "long": range(30, 41)}
    policy = PredictedPolicy(predictor=trained(apps), mode="reserve")
    a, b, c = make_seq("a", 4, "short"), make_seq("b", 4, "long"), make_seq("c", 4, "mid")
    first_victims = []

    def watch(sched: Scheduler) -> None:
        if sched.num_preemptions and not first_victims:
            first_victims.extend(s.rid for s in sched.waiting)

    # 3 + 11 + 6 pages reserved fill the pool of 20; `a` outgrows its 8 predicted tokens first.
    sched = drive(policy, [a, b, c], [30, 35, 15], num_pages=20, on_step=watch)
    assert first_victims == ["b"]  # not `c`, the newest: `b` has ~26 predicted tokens to go, `c` ~6
    assert c.num_preemptions == 0 and sched.num_preemptions >= 1
    assert [s.num_output for s in (a, b, c)] == [30, 35, 15]


def test_peak_mode_grows_from_the_free_pool_and_preempts_once_it_is_exhausted():
    policy = PredictedPolicy(predictor=trained({"chat": range(1, 5)}))  # predicts 4 tokens; they run 30
    seqs = [make_seq(str(i), 4, "chat") for i in range(3)]
    sched = drive(policy, seqs, [30, 30, 30], num_pages=27)  # 3 x 33 KV tokens: 9 pages of 4 each
    assert sched.num_preemptions == 0
    policy = PredictedPolicy(predictor=trained({"chat": range(1, 5)}))
    seqs = [make_seq(str(i), 4, "chat") for i in range(3)]
    sched = drive(policy, seqs, [30, 30, 30], num_pages=12)  # they do not
    assert sched.num_preemptions >= 1
    assert [s.num_output for s in seqs] == [30, 30, 30]


def test_learns_from_natural_ends_only_and_persists(tmp_path):
    path = tmp_path / "predictor.json"
    policy = make_policy("predicted", path=str(path), quantile=0.5)
    assert isinstance(policy, PredictedPolicy)
    policy.save_every = 20
    for i in range(30):
        seq = make_seq(str(i), 8, "chat")
        seq.token_ids += [3] * 12
        seq.finish_reason = ("stop", "length", "abort")[i % 3]
        policy.on_finish(seq)
    assert policy.predictor.num_updates == 20  # the 10 aborts taught nothing
    assert path.is_file()  # saved after 20 updates
    restarted = PredictedPolicy(path=str(path), quantile=0.5)
    assert restarted.predict_output(make_seq("x", 8, "chat"), 0.5) == 12
    with pytest.raises(ValueError):
        PredictedPolicy(quantile=1.0)


def test_engine_tokens_identical_to_max_and_optimistic_under_forced_preemption(stories_dir, tmp_path):
    from pipeserve.engine import LLM

    path = tmp_path / "predictor.json"
    pred = OutputLengthPredictor()
    for _ in range(64):  # history says every request stops after 2 tokens: reservations far too small
        pred.update(Features(0, "", 1, 1, "greedy"), 2)
    pred.save(path)
    prompts = ["Once upon a time", "The cat sat on the mat and",
               "Lily and Tom went to the park to play with a ball", "One day", "Tim had a red car. He"]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    tokens, stats = {}, {}
    for policy in ("max", "optimistic", "predicted"):
        # 14 pages of 4 tokens cannot hold five ~35-token requests at once.
        llm = LLM(stories_dir, device="cpu", dtype="float32", page_size=4, num_pages=14, admission=policy,
                  predictor_path=str(path))
        tokens[policy] = [o.token_ids for o in llm.generate(prompts, params)]
        stats[policy] = llm.engine.stats()
        if policy == "predicted":
            assert llm.engine.policy.predictor.num_updates == 64 + len(prompts)  # learned online
    assert tokens["predicted"] == tokens["max"] == tokens["optimistic"]
    assert all(len(t) == 24 for t in tokens["predicted"])
    assert stats["predicted"]["preemptions"] > 0
    assert stats["predicted"]["pages_used"] == stats["predicted"]["pages_reserved"] == 0


def test_engine_close_saves_what_the_predictor_learned_and_mode_is_configurable(stories_dir, tmp_path):
    from pipeserve.engine import LLM

    path = tmp_path / "predictor.json"
    llm = LLM(stories_dir, device="cpu", num_pages=64, admission="predicted", predictor_path=str(path),
              predictor_mode="reserve")
    assert llm.engine.policy.mode == "reserve"
    llm.generate(["Once upon a time", "One day"], SamplingParams(max_tokens=4, temperature=0.0))
    assert not path.exists()  # fewer finishes than the periodic save interval
    llm.engine.close()
    assert OutputLengthPredictor.load(path).num_updates == 2
    with pytest.raises(ValueError, match="predictor_mode"):
        LLM(stories_dir, device="cpu", num_pages=64, admission="predicted", predictor_mode="hopeful")


def test_peak_admission_counts_a_shared_prefix_once():
    """Prefix caching: requests that share their prompt's pages hold them once, until the last of
    them finishes, so the peak check charges each shared page to its latest-finishing holder."""
    policy = PredictedPolicy(predictor=trained({"short": range(1, 9), "long": range(30, 41)}))
    running = [make_seq("a", 40, "long"), make_seq("b", 40, "short")]
    new = make_seq("c", 40, "short")
    for s in (*running, new):
        policy.reservation_tokens(s, MAX_LEN)
    shared = list(range(10))  # the 40-token prompt in 4-token pages, held by a and b alike
    for s in running:
        s.pages = list(shared)
    # Lefts are 39 (a) and 8 (b, c); a finishes last and holds the prompt throughout. Before b and c
    # end: 40 + 3 x (8 + 3) = 73 tokens; before a ends: 40 + 39 + 3 = 82 tokens.
    assert policy.admits(new, running, KVPool.accounting_only(21, 4, 8, MAX_LEN), MAX_LEN, shared)
    assert not policy.admits(new, running, KVPool.accounting_only(20, 4, 8, MAX_LEN), MAX_LEN, shared)
    # Counted per request, as without sharing, the same pool of 21 pages would refuse it.
    for s in running:
        s.pages = []
    assert not policy.admits(new, running, KVPool.accounting_only(21, 4, 8, MAX_LEN), MAX_LEN)
