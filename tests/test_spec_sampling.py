"""Speculative verification is exact in distribution, at the sampler level (no model, no engine).

A toy Markov "model" (target logits for each previous token, a table [V, V]) generates sequences
of L tokens from many independently seeded rows at once, k proposals per step, through the engine's
own pieces: the Sampler's processing (temperature, top-p, top-k) and noise, the draft's sampling,
`rejection_sample` for sampled drafts and `accept_matching` for deterministic proposals. The joint
distribution of the L tokens is compared with the target chain's by a chi-square test over >= 10,000
sequences. Seeds are fixed, so the tests are deterministic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeserve.engine.sampler import Sampler, race
from pipeserve.engine.spec.acceptance import accept_matching, rejection_sample
from pipeserve.engine.spec.verifier import ACCEPT_SALT, DRAFT_SALT
from pipeserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
V, L, K, N = 5, 3, 3, 12_000


def chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square p-value, cells with an expected count under 5 pooled into one."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def make_sampler(params: SamplingParams) -> tuple[Sampler, np.ndarray, torch.Tensor]:
    sampler = Sampler(N, V, CPU)
    for slot in range(N):
        params.seed = 1000 + slot
        sampler.set_request(slot, params, [0], [], [])
    slots = np.arange(N)
    return sampler, slots, torch.as_tensor(slots)


def speculative_chain(sampler: Sampler, slots: np.ndarray, slots_t: torch.Tensor, target: torch.Tensor,
                      draft: torch.Tensor | None, K: int = K) -> tuple[np.ndarray, float]:  # noqa: N803
    """N sequences of L tokens after token 0 under target logits [V, V] (row: previous token).
    draft None: deterministic proposals (the next token's argmax under a fixed wrong table, and the
    matching rule); else the draft's logits table, sampled, and rejection sampling. Returns the
    tokens [N, L] and the mean tokens emitted per verification."""
    out = torch.full((N, L + K + 1), -1, dtype=torch.int64)
    count = torch.zeros(N, dtype=torch.int64)
    prev = torch.zeros(N, dtype=torch.int64)
    fixed = torch.roll(torch.eye(V), 1, dims=1)  # proposes prev + 1: right only by chance
    steps_emitted = []
    while int(count.min()) < L:
        # Proposals: k tokens autoregressively (a sampled draft draws one more, for the last row).
        proposals, q, ctx = [], [], prev
        for j in range(K + (draft is not None)):
            steps = count + j
            if draft is None:
                tok = fixed[ctx].argmax(-1)
            else:
                logw = sampler.processed_logits(draft[ctx], slots, slots_t, steps)
                q.append(torch.softmax(logw, -1))
                tok = race(logw, sampler.noise(slots_t, steps, DRAFT_SALT))
            proposals.append(tok)
            ctx = tok
        d = torch.stack(proposals, 1)  # [N, K] or [N, K + 1]
        contexts = torch.cat([prev[:, None], d[:, :K]], 1)  # row j sees the prefix through d_{j-1}
        steps = count[:, None] + torch.arange(K + 1)[None, :]
        logits = target[contexts].reshape(-1, V)
        rep_slots = np.repeat(slots, K + 1)
        rep_t = torch.as_tensor(rep_slots)
        p_logw = sampler.processed_logits(logits, rep_slots, rep_t, steps.reshape(-1))
        u = sampler.noise(rep_t, steps.reshape(-1))
        lens = torch.full((N,), K)
        if draft is None:  # the target samples each row as plain decoding would; keep matches
            targets = race(p_logw, u).view(N, K + 1)
            kept = accept_matching(targets.numpy(), d.numpy(), lens.numpy())
            tokens, emitted = targets, torch.as_tensor(kept) + 1
        else:
            u_accept = sampler.noise(rep_t, steps.reshape(-1), ACCEPT_SALT)[:, 0].view(N, K + 1)
            tokens, emitted = rejection_sample(p_logw.view(N, K + 1, V), torch.stack(q, 1), d, lens,
                                               u_accept, u.view(N, K + 1, V))
        steps_emitted.append(emitted.float().mean().item())
        cols = count[:, None] + torch.arange(K + 1)[None, :]
        write = (torch.arange(K + 1)[None, :] < emitted[:, None]) & (cols < out.shape[1])
        out[torch.arange(N)[:, None].expand_as(cols)[write], cols[write]] = tokens[write]
        prev = tokens.gather(1, (emitted - 1)[:, None]).squeeze(1)
        count += emitted
    return out[:, :L].numpy(), float(np.mean(steps_emitted))


def chain_probabilities(sampler: Sampler, target: torch.Tensor) -> np.ndarray:
    """Exact probabilities [V ** L] of every L-token sequence after token 0 (the sampler's
    processing has no step dependence without min_tokens)."""
    one = np.zeros(1, dtype=np.int64)
    logw = sampler.processed_logits(target, np.repeat(one, V), torch.zeros(V, dtype=torch.int64),
                                    torch.zeros(V, dtype=torch.int64))
    trans = torch.softmax(logw, -1).double().numpy()  # [prev, next]
    probs = trans[0]
    for _ in range(L - 1):  # probs[..., prev] * trans[prev, next], one axis per token
        probs = probs[..., :, None] * trans
    return probs.reshape(-1)


def joint_counts(tokens: np.ndarray) -> np.ndarray:
    index = np.zeros(len(tokens), dtype=np.int64)
    for col in range(L):
        index = index * V + tokens[:, col]
    return np.bincount(index, minlength=V**L).astype(np.float64)


TARGET = torch.randn(V, V, generator=torch.Generator().manual_seed(7)) * 1.5
GOOD_DRAFT = TARGET + 0.3 * torch.randn(V, V, generator=torch.Generator().manual_seed(8))
BAD_DRAFT = -2.0 * TARGET  # prefers what the target avoids


SETTINGS = [(1.0, 1.0, -1), (0.6, 1.0, -1), (1.5, 0.8, -1), (1.0, 0.9, 3)]
FAST = {("good", 1.0, 1.0, -1), ("bad", 1.5, 0.8, -1)}
CASES = [
    pytest.param(d, *c, id=f"{d}-t{c[0]}-p{c[1]}-k{c[2]}",
                 marks=() if (d, *c) in FAST else pytest.mark.slow)
    for d in ("good", "bad", "deterministic")
    for c in SETTINGS
]


@pytest.mark.parametrize("draft,temperature,top_p,top_k", CASES)
def test_speculative_chain_matches_the_target(draft, temperature, top_p, top_k):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    sampler, slots, slots_t = make_sampler(params)
    table = {"good": GOOD_DRAFT, "bad": BAD_DRAFT, "deterministic": None}[draft]
    tokens, per_step = speculative_chain(sampler, slots, slots_t, TARGET, table)
    expected = chain_probabilities(sampler, TARGET) * N
    assert chi2_pvalue(joint_counts(tokens), expected) > 1e-3
    if draft == "good":
        assert per_step > 2.0  # a draft close to the target keeps most proposals
    if draft == "bad":
        assert per_step < 1.5  # it only costs speed


@pytest.mark.slow
def test_bad_draft_shifts_a_naive_acceptance_rule():
    """Control: keeping every draft token (no verification) fails the same test, so it can fail."""
    params = SamplingParams(temperature=1.0)
    sampler, slots, slots_t = make_sampler(params)
    steps = torch.zeros(N, dtype=torch.int64)
    ctx = torch.zeros(N, dtype=torch.int64)
    tokens = []
    for j in range(L):
        logw = sampler.processed_logits(BAD_DRAFT[ctx], slots, slots_t, steps + j)
        ctx = race(logw, sampler.noise(slots_t, steps + j, DRAFT_SALT))
        tokens.append(ctx)
    expected = chain_probabilities(sampler, TARGET) * N
    assert chi2_pvalue(joint_counts(torch.stack(tokens, 1).numpy()), expected) < 1e-6


@pytest.mark.slow
def test_seeded_tokens_do_not_depend_on_the_proposal_size():
    """Every output index is decided by the same rule from (prefix, seed, index), so the adaptive
    rule may change k without changing a seeded request's tokens."""
    sampler, slots, slots_t = make_sampler(SamplingParams(temperature=0.9, top_p=0.95))
    runs = [speculative_chain(sampler, slots, slots_t, TARGET, GOOD_DRAFT, k)[0] for k in (1, 2, 4)]
    assert (runs[0] == runs[1]).all() and (runs[0] == runs[2]).all()
