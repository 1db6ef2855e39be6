"""Prompt logprobs computed during prefill equal Hugging Face's log-softmax over the same prompt, for
whole and chunked prefills, beside decoding requests, and never from a prefix-cache hit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeserve.engine.engine import Engine
from pipeserve.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # builds and runs a Hugging Face reference

PROMPTS = [[1, 5, 9, 13, 2, 7, 30, 31, 4, 11, 19, 3, 8], [1, 40, 41], [1, 6]]
K = 3


@pytest.fixture(scope="module")
def reference(tiny_model):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model("llama")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
            chosen = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            out.append((chosen.numpy(), lp[:-1].topk(K, -1)))
    return model_dir, out


def run(model_dir: str, prompts: list[list[int]], asks: list[int | None], **options) -> dict:
    engine = Engine(model=model_dir, device="cpu", dtype="float32", **options)
    got = {}
    for i, (ids, k) in enumerate(zip(prompts, asks, strict=True)):
        engine.add(f"r{i}", ids, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=k))
    while engine.has_work():
        for update in engine.step():
            if update.new:
                got[update.rid] = update.prompt_logprobs
    return got


@pytest.mark.parametrize(
    "options",
    # few-seqs: a prompt's rows read out beside another request outnumber the batch's sequences.
    [{}, {"max_num_batched_tokens": 4, "page_size": 4}, {"max_num_seqs": 2}],
    ids=["whole", "chunked", "few-seqs"],
)
def test_prompt_logprobs_equal_hf(reference, options):
    model_dir, expected = reference
    got = run(model_dir, PROMPTS, [K, None, K], **options)
    assert got["r1"] is None  # it did not ask
    for rid, i in (("r0", 0), ("r2", 2)):
        lp = got[rid]
        chosen, (top_lps, top_ids) = expected[i]
        assert np.isnan(lp.logprobs[0]) and lp.logprobs.shape == (len(PROMPTS[i]),)
        np.testing.assert_allclose(lp.logprobs[1:], chosen, atol=1e-4)
        np.testing.assert_array_equal(lp.top_ids[1:], top_ids.numpy())
        np.testing.assert_allclose(lp.top_logprobs[1:], top_lps.numpy(), atol=1e-4)


def test_prompt_logprobs_are_recomputed_not_read_from_the_prefix_cache(reference):
    """The same prompt twice with prefix caching: the second asks, so it runs every row (no hit)."""
    model_dir, expected = reference
    engine = Engine(model=model_dir, device="cpu", dtype="float32", page_size=4)
    got = {}
    for rid, k in (("warm", None), ("ask", 0)):
        engine.add(rid, PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k))
        while engine.has_work():
            for update in engine.step():
                if update.new:
                    got[rid] = (update.prompt_logprobs, update.seq.num_cached_tokens)
    lp, cached = got["ask"]
    assert cached == 0 and got["warm"][1] == 0
    assert lp.top_ids.shape == (len(PROMPTS[0]), 0)
    np.testing.assert_allclose(lp.logprobs[1:], expected[0][0], atol=1e-4)
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == 0


def test_a_request_alone_reads_every_row(reference):
    """Its rows are all the batch's (extra rows and the sampled row): read back in batch order."""
    model_dir, expected = reference
    lp = run(model_dir, [PROMPTS[0]], [K])["r0"]
    np.testing.assert_allclose(lp.logprobs[1:], expected[0][0], atol=1e-4)
    np.testing.assert_array_equal(lp.top_ids[1:], expected[0][1][1].numpy())


def test_offline_llm_returns_prompt_logprobs(reference):
    from pipeserve.engine.llm import LLM

    model_dir, expected = reference
    llm = LLM(model_dir, device="cpu", dtype="float32")
    (out,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=K))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPTS[0])
    np.testing.assert_allclose([e["logprob"] for e in out.prompt_logprobs[1:]], expected[0][0], atol=1e-4)
    assert list(out.prompt_logprobs[1]["top"]) == expected[0][1][1][0].tolist()
