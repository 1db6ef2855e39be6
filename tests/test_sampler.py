"""The on-device sampler (pipeserve/engine/sampler.py), on the test device ($PIPESERVE_TEST_DEVICE).

Statistical tests use fixed seeds, so they are deterministic; their thresholds are chi-square
critical values at alpha = 1e-4 (Wilson-Hilferty), generous enough for any healthy RNG."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeserve.engine.sampler import Sampler, mix32, race, row_keys, uniform, uniform_rows, vocab_keys
from pipeserve.sampling_params import SamplingParams
from tests.conftest import TEST_DEVICE
from tests.kernel_utils import DEVICE

pytestmark = [pytest.mark.timeout(60), pytest.mark.device]
SHARED = Path(os.environ.get("PIPESERVE_SHARED", Path(__file__).resolve().parents[2] / "shared"))
STORIES = SHARED / "models" / "stories260K"


def randn(*shape: int, seed: int) -> torch.Tensor:
    """Seeded normal draws, the same on every device: drawn on the CPU, then moved."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), device="cpu").to(DEVICE)


def on_device(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).to(DEVICE)


def sample(sampler: Sampler, logits: torch.Tensor, slots: list[int]):
    return sampler.sample(logits, np.asarray(slots, dtype=np.int64), torch.tensor(slots, dtype=torch.int64))


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.719 is alpha = 1e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def lowbias32(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_mix32_is_exact_lowbias32_without_int64_overflow():
    values = [0, 1, 2, 0xDEADBEEF, 2**31 - 1, 2**31, 2**32 - 1] + np.random.default_rng(0).integers(
        0, 2**32, 2000
    ).tolist()
    assert mix32(torch.tensor(values, dtype=torch.int64)).tolist() == [lowbias32(v) for v in values]


def test_uniform_is_a_pure_function_in_the_open_interval():
    keys = vocab_keys(1000, DEVICE)
    seeds = torch.tensor([0, 1, 2**62 + 7, 12345], dtype=torch.int64)
    steps = torch.tensor([0, 0, 3, 99], dtype=torch.int64)
    u = uniform(seeds, steps, keys)
    assert u.dtype == torch.float32 and u.shape == (4, 1000)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert abs(u.mean().item() - 0.5) < 0.01
    # Row-local: the same (seed, step) gives the same row in any batch.
    alone = uniform(seeds[2:3], steps[2:3], keys)
    assert torch.equal(alone[0], u[2])
    assert not torch.equal(u[0], u[1])


def test_row_keys_hash_the_same_on_the_host_and_the_device():
    """The sampler hashes its rows' keys from host mirrors (numpy): every int64 seed (negative ones
    too) and step gives the bits the device path gives, so the noise, and the tokens, are the same."""
    rng = np.random.default_rng(0)
    seeds = np.concatenate([rng.integers(-2**63, 2**63 - 1, 500, dtype=np.int64),
                            np.array([0, -1, 2**63 - 1, -2**63, 2**32, 2**32 - 1], dtype=np.int64)])
    steps = rng.integers(0, 2**40, len(seeds), dtype=np.int64)
    host = row_keys(seeds, steps)
    device = row_keys(torch.from_numpy(seeds).to(DEVICE), torch.from_numpy(steps).to(DEVICE))
    assert host.dtype == np.int64 and host.tolist() == device.cpu().tolist()
    keys = vocab_keys(64, DEVICE)
    rows = torch.from_numpy(host).to(DEVICE)
    assert torch.equal(uniform_rows(rows, keys), uniform(torch.from_numpy(seeds).to(DEVICE),
                                                         torch.from_numpy(steps).to(DEVICE), keys))


def test_sampled_tokens_race_the_noise_of_their_seed_and_step():
    sampler = Sampler(4, 64, DEVICE)
    for slot, seed in enumerate((3, -5, 2**62 + 1)):
        sampler.set_request(slot, SamplingParams(temperature=0.7, seed=seed), [1], [], [0])
    slots = np.array([2, 0, 1])
    slots_t = torch.from_numpy(slots).to(DEVICE)
    for step in range(5):
        logits = randn(3, 64, seed=step)
        steps = sampler.generated[slots_t].clone()
        want = race(logits / sampler.temperature[slots_t, None], sampler.noise(slots_t, steps))
        assert sample(sampler, logits, slots.tolist()).tokens.cpu().tolist() == want.cpu().tolist()


def test_greedy_is_argmax_for_any_float_dtype():
    sampler = Sampler(8, 100, DEVICE)
    for slot in range(6):
        sampler.set_request(slot, SamplingParams(temperature=0.0), [1, 2], [], [0])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = randn(6, 100, seed=1).to(dtype)
        out = sample(sampler, logits, [3, 0, 5, 1, 2, 4])
        assert out.tokens.dtype == torch.int64
        assert torch.equal(out.tokens, logits.float().argmax(-1))
        assert out.logprobs is None and out.top_ids is None


def test_tiny_temperature_is_greedy():
    sampler = Sampler(2, 50, DEVICE)
    sampler.set_request(0, SamplingParams(temperature=1e-7, seed=3), [], [], [])
    logits = torch.randn(1, 50)
    assert torch.equal(sample(sampler, logits, [0]).tokens, logits.argmax(-1))


def penalised_reference(row: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int]):
    """Straightforward per-row penalties: HF repetition over prompt + output, then OpenAI
    presence / frequency over output."""
    row = row.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        row[t] = row[t] / params.repetition_penalty if row[t] > 0 else row[t] * params.repetition_penalty
    for t in set(output):
        row[t] -= params.presence_penalty + params.frequency_penalty * output.count(t)
    return row


PENALTIES = {
    "repetition": SamplingParams(temperature=0.0, repetition_penalty=1.8),
    "presence": SamplingParams(temperature=0.0, presence_penalty=1.5),
    "frequency": SamplingParams(temperature=0.0, frequency_penalty=0.6),
    "all": SamplingParams(
        temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4
    ),
}


@pytest.mark.parametrize("name", list(PENALTIES))
def test_penalties_match_per_row_reference(name: str):
    """Greedy trajectories over 12 steps of 16 rows: the argmax after penalties (which feed back
    through the output counts) equals that of a per-row reference."""
    params, vocab, rows, steps = PENALTIES[name], 16, 16, 12
    gen = np.random.default_rng(7)
    prompts = [gen.integers(0, vocab, 5).tolist() for _ in range(rows)]
    sampler = Sampler(rows + 4, vocab, DEVICE)
    slots = [rows + 3 - i for i in range(rows)]  # not the identity, to catch slot / row mix-ups
    for slot, prompt in zip(slots, prompts, strict=True):
        sampler.set_request(slot, params, prompt, [], [])
    outputs: list[list[int]] = [[] for _ in range(rows)]
    changed = 0
    for _ in range(steps):
        logits = gen.normal(0.0, 2.0, (rows, vocab)).astype(np.float32)
        tokens = sample(sampler, on_device(logits), slots).tokens.tolist()
        for r in range(rows):
            expected = int(penalised_reference(logits[r], params, prompts[r], outputs[r]).argmax())
            assert tokens[r] == expected, (r, outputs[r])
            changed += expected != int(logits[r].argmax())
            outputs[r].append(tokens[r])
    assert changed > 10  # the penalty mattered


def test_penalty_state_survives_readmission():
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.8)
    gen = np.random.default_rng(3)
    logits = [on_device(gen.normal(0, 1, (1, 12)).astype(np.float32)) for _ in range(10)]
    straight = Sampler(4, 12, DEVICE)
    straight.set_request(2, params, [1, 5], [], [])
    expected = [sample(straight, x, [2]).tokens.item() for x in logits]
    resumed = Sampler(4, 12, DEVICE)
    resumed.set_request(0, params, [1, 5], [], [])
    got = [sample(resumed, x, [0]).tokens.item() for x in logits[:5]]
    resumed.free(0)
    resumed.set_request(3, params, [1, 5], got, [])
    got += [sample(resumed, x, [3]).tokens.item() for x in logits[5:]]
    assert got == expected


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_ids(temperature: float):
    vocab, eos, stop = 20, 2, 7
    sampler = Sampler(4, vocab, DEVICE)
    blocked = SamplingParams(temperature=temperature, min_tokens=3, seed=1)
    sampler.set_request(1, blocked, [1], [], [eos, stop])
    sampler.set_request(0, SamplingParams(temperature=temperature, seed=2), [1], [], [eos, stop])
    # Ten stop ids widen the padded stop-id buffer past its initial width.
    many = list(range(10, 20))
    sampler.set_request(2, SamplingParams(temperature=temperature, min_tokens=2, seed=3), [1], [], many)
    logits = torch.zeros(3, vocab)
    logits[:2, eos], logits[:2, stop] = 30.0, 29.0
    logits[2, 10:] = 30.0
    history = [sample(sampler, logits, [1, 0, 2]).tokens.tolist() for _ in range(4)]
    for step, (row_blocked, row_free, row_many) in enumerate(history):
        assert row_free in (eos, stop)
        if step < 3:
            assert row_blocked not in (eos, stop)
        else:
            assert row_blocked in (eos, stop)
        assert (row_many in many) == (step >= 2)


def seeded_run(
    sampler: Sampler, slot: int, others: dict[int, SamplingParams], row: int, steps: range, vocab: int
) -> list[int]:
    """Sample `steps` of the step-indexed logits for `slot`, batched with `others` placed around
    it so that it sits at batch row `row`."""
    tokens = []
    for step in steps:
        target = randn(vocab, seed=1000 + step)
        noise = randn(len(others), vocab, seed=step)
        logits = torch.cat([noise[:row], target[None], noise[row:]])
        slots = list(others)[:row] + [slot] + list(others)[row:]
        tokens.append(sample(sampler, logits, slots).tokens[row].item())
    return tokens


SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=1234)


def test_seeded_sampling_independent_of_batch_and_slot_and_resumes():
    vocab = 64
    alone = Sampler(1, vocab, DEVICE)
    alone.set_request(0, SEEDED, [1], [], [])
    expected = seeded_run(alone, 0, {}, 0, range(10), vocab)

    crowd = Sampler(16, vocab, DEVICE)
    others = {
        3: SamplingParams(temperature=0.0),
        11: SamplingParams(top_p=0.5, seed=9),
        0: SamplingParams(temperature=1.3),
        7: SamplingParams(top_k=3, repetition_penalty=1.2),
    }
    for slot, params in others.items():
        crowd.set_request(slot, params, [4, 5], [], [2])
    crowd.set_request(9, SEEDED, [1], [], [])
    assert seeded_run(crowd, 9, others, 2, range(10), vocab) == expected

    # Preempted after 4 tokens, re-admitted elsewhere with its output: the stream continues.
    resumed = Sampler(8, vocab, DEVICE)
    resumed.set_request(5, SEEDED, [1], [], [])
    first = seeded_run(resumed, 5, {}, 0, range(4), vocab)
    resumed.free(5)
    resumed.set_request(1, SEEDED, [1], first, [])
    assert first + seeded_run(resumed, 1, {}, 0, range(4, 10), vocab) == expected

    other_seed = Sampler(1, vocab, DEVICE)
    other_seed.set_request(
        0, SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=4321), [1], [], []
    )
    assert seeded_run(other_seed, 0, {}, 0, range(10), vocab) != expected


def test_unseeded_requests_draw_their_own_seeds():
    vocab = 64
    sampler = Sampler(2, vocab, DEVICE, seed=0)
    sampler.set_request(0, SamplingParams(), [], [], [])
    sampler.set_request(1, SamplingParams(), [], [], [])
    logits = torch.zeros(2, vocab)  # uniform: any correlation between the two rows would show
    draws = torch.stack([sample(sampler, logits, [0, 1]).tokens for _ in range(10)])
    assert not torch.equal(draws[:, 0], draws[:, 1])


def draw_counts(params: SamplingParams, logits: np.ndarray, rows: int = 512, steps: int = 8) -> np.ndarray:
    """Token frequencies over rows * steps draws of one logits row, each row with its own seed."""
    vocab = len(logits)
    sampler = Sampler(rows, vocab, DEVICE)
    for slot in range(rows):
        params.seed = 10_000 + slot
        sampler.set_request(slot, params, [], [], [])
    batch = on_device(np.tile(logits.astype(np.float32), (rows, 1)))
    slots = list(range(rows))
    tokens = torch.cat([sample(sampler, batch, slots).tokens for _ in range(steps)])
    return np.bincount(tokens.cpu().numpy(), minlength=vocab)


def reference_probs(
    logits: np.ndarray, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """Straightforward float64 filtering: top-k, then top-p on the renormalised rest, then min-p."""
    probs = np.exp(logits / temperature - np.max(logits / temperature))
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = np.zeros(len(probs), dtype=bool)
    kept = order[: top_k if top_k > 0 else len(probs)]
    renorm = probs[kept] / probs[kept].sum()
    mass = 0.0
    for token, p in zip(kept, renorm, strict=True):
        if mass > top_p:
            break
        keep[token] = True
        mass += p
    keep &= probs >= min_p * probs.max()
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


# A fixed permutation so that the allowed sets are not a prefix of the vocabulary.
BASE = np.array([2.0, 1.5, 1.2, 0.8, 0.5, 0.0, -0.3, -1.0])[[5, 2, 7, 0, 3, 6, 1, 4]]


@pytest.mark.parametrize(
    ("options", "allowed"),
    [
        ({"temperature": 0.7}, 8),
        ({"temperature": 1.0}, 8),
        ({"top_k": 3}, 3),
        ({"top_p": 0.75}, 4),
        ({"min_p": 0.2}, 5),
        ({"temperature": 1.5, "top_k": 6, "top_p": 0.9, "min_p": 0.4}, 4),
    ],
)
def test_sampled_frequencies_match_renormalised_softmax(options: dict, allowed: int):
    expected = reference_probs(BASE, **options)
    assert (expected > 0).sum() == allowed  # each filter really cuts where the test says
    counts = draw_counts(SamplingParams(**options), BASE)
    assert counts[expected == 0].sum() == 0
    n = counts.sum()
    support = expected > 0
    chi2 = (((counts[support] - n * expected[support]) ** 2) / (n * expected[support])).sum()
    assert chi2 < chi2_critical(allowed - 1), (counts, n * expected)


def test_wide_vocab_temperature_sampling_matches_softmax():
    logits = np.random.default_rng(5).normal(0.0, 0.7, 32)
    expected = reference_probs(logits)
    counts = draw_counts(SamplingParams(temperature=1.0), logits, rows=1024, steps=8)
    n = counts.sum()
    chi2 = (((counts - n * expected) ** 2) / (n * expected)).sum()
    assert chi2 < chi2_critical(31)


def test_logprobs_are_raw_log_softmax_with_true_top_ids():
    vocab = 300
    sampler = Sampler(8, vocab, DEVICE)
    requests = {
        4: SamplingParams(temperature=0.0, logprobs=2),
        1: SamplingParams(temperature=0.8, top_k=10, seed=5, logprobs=5),
        6: SamplingParams(temperature=1.2, repetition_penalty=1.5, seed=6, logprobs=0),
        0: SamplingParams(temperature=0.0),
    }
    for slot, params in requests.items():
        sampler.set_request(slot, params, [3, 4], [], [])
    for dtype in (torch.float32, torch.bfloat16):
        logits = (3 * randn(4, vocab, seed=2)).to(dtype)
        out = sample(sampler, logits, list(requests))
        reference = torch.log_softmax(logits.float(), dim=-1)
        assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
        assert out.logprobs.dtype == torch.float32 and out.top_ids.dtype == torch.int64
        assert out.top_ids.shape == out.top_logprobs.shape == (4, 5)
        torch.testing.assert_close(
            out.logprobs, reference.gather(1, out.tokens[:, None])[:, 0], atol=1e-5, rtol=0
        )
        assert torch.equal(out.top_ids, reference.argsort(dim=-1, descending=True)[:, :5])
        torch.testing.assert_close(out.top_logprobs, reference.gather(1, out.top_ids), atol=1e-5, rtol=0)


def test_mixed_greedy_and_sampled_rows():
    vocab = 128
    params = {
        0: SamplingParams(temperature=0.0),
        1: SamplingParams(temperature=1.0, top_p=0.8, seed=77),
        2: SamplingParams(temperature=0.0, repetition_penalty=2.0),
        3: SamplingParams(temperature=0.7, min_p=0.05, seed=78),
    }
    mixed = Sampler(4, vocab, DEVICE)
    for slot, p in params.items():
        mixed.set_request(slot, p, [9], [], [])
    logits = 4 * randn(4, vocab, seed=11)
    logits[2, 9] = 100.0  # the prompt token: repetition penalty 2 halves it, still the max
    tokens = sample(mixed, logits, [0, 1, 2, 3]).tokens
    assert tokens[0].item() == logits[0].argmax().item()
    assert tokens[2].item() == 9
    for row in (1, 3):
        alone = Sampler(1, vocab, DEVICE)
        alone.set_request(0, params[row], [9], [], [])
        assert tokens[row].item() == sample(alone, logits[row : row + 1], [0]).tokens.item()


@pytest.mark.skipif(not (STORIES / "config.json").exists(), reason=f"stories260K not found under {SHARED}")
@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the transformers reference runs on the CPU")
def test_matches_hf_greedy_repetition_penalty_and_logprobs():
    """HF generate on the real tiny Llama as the oracle: our greedy + repetition penalty on its raw
    logits picks HF's tokens, and our logprobs equal its normalised transition scores."""
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(STORIES).eval()
    prompt = [1, 403, 407, 261, 378]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            repetition_penalty=1.3,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    hf_tokens = out.sequences[0, len(prompt) :].tolist()
    scores = model.compute_transition_scores(out.sequences, out.logits, normalize_logits=True)[0]
    sampler = Sampler(2, model.config.vocab_size, torch.device("cpu"))
    sampler.set_request(
        1, SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=1), prompt, [], [2]
    )
    for step, raw in enumerate(out.logits):
        got = sample(sampler, raw, [1])
        assert got.tokens.item() == hf_tokens[step]
        assert abs(got.logprobs.item() - scores[step].item()) < 1e-4
