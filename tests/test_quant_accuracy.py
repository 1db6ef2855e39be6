"""Accuracy gates of quantized serving on a real model: stories260K perplexity on a held-out text the
test writes itself (simple children's stories, ~3000 tokens), per configuration through the engine
(LLM(..., quantization=, kv_cache_dtype=)), against the unquantized model; greedy agreement reported.

Gates (perplexity increase): INT8 KV and FP8 KV 1%, W8A8 INT8 2%, W8A8 FP8 3%, W4A16 and NF4 15% (every
weight matters at 260K parameters). Both KV caches store keys less their sequence's mean key
(quantization/kv_cache.key_means; attention unchanged). Without that shift FP8 KV costs +1.46%
here: e4m3 keeps 3 mantissa bits, so each cached element is off by up to 1/16 of its size, and this
model's keys carry a per-channel bias up to ~20 against a spread of ~3 (head_dim 8; fp8 only on V
costs 0.0%, only on K +2.0%). With it: FP8 +0.26%, INT8 +0.00% (was +0.47%). On five other texts
(seeds 2-6) at windows of 128/256/512 tokens FP8 averages +0.37/+0.44/+0.87% (worst +0.57/+0.66/+1.14%;
unshifted +1.41/+1.39/+1.82%) and INT8 +0.05/+0.03/+0.04% (unshifted +0.07/+0.26/+0.27%).
"""

from __future__ import annotations

import pytest
import torch

from pipeserve.engine import LLM, SamplingParams
from pipeserve.engine.model.accuracy import (
    logits_error,
    perplexity,
    story_text,
    teacher_forced_logits,
    token_agreement,
    windows,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("torch_one_thread")]

GATES = {  # (quantization, kv_cache_dtype) -> max perplexity increase, %
    ("none", "int8"): 1.0,
    ("none", "fp8"): 1.0,
    ("w8a8-int8", "auto"): 2.0,
    ("w8a8-fp8", "auto"): 3.0,
    ("w4a16", "auto"): 15.0,
    ("nf4", "auto"): 15.0,
}
PROMPTS = ["Once upon a time", "Tom and Sue found a ball", "The little cat was sad"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def run(stories_dir: str, seqs: list[list[int]], quantization: str = "none", kv: str = "auto"):
    llm = LLM(stories_dir, device="cpu", quantization=quantization, kv_cache_dtype=kv, num_pages=64,
              step_executor="eager")
    logits = teacher_forced_logits(llm.engine.model, seqs, kv)
    outputs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return llm, logits, outputs


@pytest.fixture(scope="module")
def reference(stories_dir):
    llm = LLM(stories_dir, device="cpu", num_pages=64)
    ids = llm.tokenizer(story_text(20, seed=1), add_special_tokens=False).input_ids
    assert 2500 < len(ids) < 4000
    seqs = windows(ids, 256, llm.engine.model_config.bos_token_id)
    logits = teacher_forced_logits(llm.engine.model, seqs)
    outputs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return {"llm": llm, "seqs": seqs, "logits": logits, "ppl": perplexity(logits, seqs), "outputs": outputs}


@pytest.mark.parametrize("quantization,kv", list(GATES))
def test_perplexity_gate(stories_dir, reference, quantization, kv):
    seqs = reference["seqs"]
    llm, logits, outputs = run(stories_dir, seqs, quantization, kv)
    assert llm.engine.model_info()["quantization"] == quantization
    ppl = perplexity(logits, seqs)
    delta = 100 * (ppl / reference["ppl"] - 1)
    agreement = token_agreement(outputs, reference["outputs"])
    # Coherence: the unquantized model finds the quantized model's greedy text about as likely as its own.
    ref_model = reference["llm"].engine.model
    prompts = [llm.tokenizer(p).input_ids for p in PROMPTS]
    own = [p + o for p, o in zip(prompts, reference["outputs"], strict=True)]
    theirs = [p + o for p, o in zip(prompts, outputs, strict=True)]
    own_ppl = perplexity(teacher_forced_logits(ref_model, own), own)
    their_ppl = perplexity(teacher_forced_logits(ref_model, theirs), theirs)
    print(f"\n{quantization:>9} kv {kv:>4}: ppl {ppl:.4f} vs {reference['ppl']:.4f} ({delta:+.2f}%, gate "
          f"{GATES[quantization, kv]}%), logits err {logits_error(logits, reference['logits']):.4f}, greedy "
          f"agreement {agreement:.2f}, greedy text ppl under the float model {their_ppl:.2f} "
          f"(its own {own_ppl:.2f})")
    assert delta <= GATES[quantization, kv]
    assert their_ppl < 2 * own_ppl
    assert torch.isfinite(torch.cat(logits)).all()
