"""The online output-length predictor: quantiles, backoff, persistence, bounds and speed."""

from __future__ import annotations

import json
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeserve.engine.kv.predictor import (
    EDGES,
    PREFIX_TOKENS,
    Features,
    Histogram,
    OutputLengthPredictor,
    bin_of,
    prefix_hash,
)
from pipeserve.engine.sequence import Sequence
from pipeserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)


def feat(app: str = "chat", prompt_len: int = 100, prefix: int = 7, max_tokens: int = 2048) -> Features:
    return Features(prefix, app, prompt_len, max_tokens, "greedy")


def test_bins_cover_every_length_once():
    assert EDGES[:16] == list(range(1, 17))
    for length in [*range(1, 3000), 10**5, 10**6]:
        b = bin_of(length)
        assert EDGES[b] <= length < EDGES[b + 1] or b == len(EDGES) - 2
    widths = [(EDGES[i + 1] - EDGES[i]) / EDGES[i] for i in range(16, len(EDGES) - 1)]
    assert max(widths) <= 0.125 and widths[-1] < 0.1  # 2 ** (1/8) - 1 = 9%, rounded to whole tokens


def test_quantiles_exact_for_short_outputs_and_conditional():
    pred = OutputLengthPredictor(min_count=1)
    for n in range(1, 11):  # 1..10, ten times each
        for _ in range(10):
            pred.update(feat(), n)
    assert pred.predict(feat(), 0.5) == 5
    assert pred.predict(feat(), 0.9) == 9
    assert pred.predict(feat(), 0.99) == 10
    # Given 5 tokens already out: the rest are uniform on 6..10.
    assert pred.predict(feat(), 0.5, above=5) == 8
    assert pred.predict(feat(), 0.9, above=9) == 10
    # Nothing observed beyond 10 at any level: no prediction rather than a guess.
    assert pred.predict(feat(), 0.5, above=10) is None


def test_no_history_means_no_prediction_and_backoff_to_coarser_keys():
    pred = OutputLengthPredictor(min_count=16)
    assert pred.predict(feat(), 0.9) is None
    rng = random.Random(0)
    for _ in range(200):
        pred.update(feat("chat", prefix=rng.randrange(10**6)), rng.randint(100, 200))  # every prompt unique
        pred.update(feat("code", prefix=rng.randrange(10**6)), rng.randint(5, 15))
    # A new template falls back to its app; the two apps stay apart.
    assert 120 <= pred.predict(feat("chat", prefix=1), 0.5) <= 180
    assert 5 <= pred.predict(feat("code", prefix=1), 0.5) <= 15
    # An unknown app falls back to prompt length / everything: somewhere in the mixture.
    assert 5 <= pred.predict(feat("new-app"), 0.5) <= 200
    # A template seen often enough gets its own answer even inside a busy app.
    for _ in range(20):
        pred.update(feat("chat", prefix=42), 1000)
    assert pred.predict(feat("chat", prefix=42), 0.5) >= 900


def test_features_of_sequence_hash_the_prompt_prefix_only():
    def seq(ids: list[int], app: str = "a", temperature: float = 0.0) -> Sequence:
        params = SamplingParams(max_tokens=64, temperature=temperature)
        return Sequence("r", ids + [9, 9], len(ids), params, 0.0, app)

    template = list(range(PREFIX_TOKENS))
    a, b = Features.of(seq(template + [1, 2, 3])), Features.of(seq(template + [4, 5]))
    assert a.prefix == b.prefix == prefix_hash(template)
    assert (a.prompt_len, a.max_tokens, a.app, a.sampling) == (PREFIX_TOKENS + 3, 64, "a", "greedy")
    assert Features.of(seq([1, 2])).prefix == prefix_hash([1, 2])  # generated ids never count
    assert Features.of(seq([1, 2])).prefix != Features.of(seq([1, 3])).prefix
    assert Features.of(seq([1], temperature=0.7)).sampling == "t3"


def test_persistence_round_trip_and_bad_files(tmp_path):
    pred = OutputLengthPredictor(min_count=4)
    rng = random.Random(1)
    samples = [(feat(rng.choice("abc"), rng.randint(1, 4000), rng.randrange(5)), rng.randint(1, 900))
               for _ in range(500)]
    for f, n in samples:
        pred.update(f, n)
    path = tmp_path / "sub" / "predictor.json"
    pred.save(path)
    assert path.stat().st_size < 128 * 1024
    back = OutputLengthPredictor.load(path)
    assert len(back) == len(pred) and back.num_updates == 500
    for f, _ in samples[:100]:
        for q in (0.5, 0.9):
            assert back.predict(f, q) == pred.predict(f, q)
    assert not list(tmp_path.glob("sub/*.tmp"))  # the atomic write left nothing behind
    # Missing, corrupt or foreign files cost the history, never the server.
    assert len(OutputLengthPredictor.load(tmp_path / "missing.json")) == 0
    (tmp_path / "bad.json").write_text("{not json")
    assert OutputLengthPredictor.load(tmp_path / "bad.json").predict(samples[0][0], 0.9) is None
    data = json.loads(path.read_text())
    data["bins_per_octave"] = 4
    (tmp_path / "other.json").write_text(json.dumps(data))
    assert len(OutputLengthPredictor.load(tmp_path / "other.json")) == 0


def test_memory_is_bounded_and_old_traffic_fades():
    pred = OutputLengthPredictor(max_keys=64, window=200, min_count=8)
    for i in range(5000):
        pred.update(feat(prefix=i), 10)  # 5000 templates, 2 new keys each
    assert len(pred) == 64
    assert pred.predict(feat(prefix=-1), 0.5) == 10  # the coarse keys survive: always recently used
    for _ in range(1000):
        pred.update(feat(prefix=-1), 500)  # the app changed its behaviour
    assert 450 <= pred.predict(feat(prefix=-2), 0.5) <= 550
    h = Histogram()
    for _ in range(10_000):
        h.add(3, window=200)
    assert h.total <= 200


def test_predict_and_update_take_microseconds():
    pred = OutputLengthPredictor()
    rng = random.Random(2)
    feats = [feat(rng.choice(["a", "b", "c"]), rng.randint(1, 8000), rng.randrange(50)) for _ in range(5000)]
    for f in feats:
        pred.update(f, rng.randint(1, 2000))
    t0 = time.perf_counter()
    for f in feats:
        pred.predict(f, 0.9)
    t1 = time.perf_counter()
    for f in feats:
        pred.update(f, 100)
    t2 = time.perf_counter()
    predict_us, update_us = (t1 - t0) / len(feats) * 1e6, (t2 - t1) / len(feats) * 1e6
    print(f"predict {predict_us:.2f} us, update {update_us:.2f} us")
    assert predict_us < 100 and update_us < 200  # ~3 and ~10 us unloaded; generous for a busy CI box


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=80), st.floats(0.01, 0.99), st.floats(0.01, 0.99),
       st.integers(0, 5000))
def test_quantiles_are_monotone_and_within_the_data(lengths, q1, q2, above):
    h = Histogram()
    for n in lengths:
        h.add(n, window=1e9)
    lo, hi = sorted((q1, q2))
    assert h.quantile(lo) <= h.quantile(hi)
    assert EDGES[bin_of(min(lengths))] <= h.quantile(lo) <= max(lengths) * 1.1 + 1
    if h.total - h.mass_at_most(above) > 1e-9:
        assert h.quantile(lo, above) > above
        assert h.quantile(lo, above) >= h.quantile(lo)
