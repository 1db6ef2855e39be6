"""The step executor: chosen once from the config and the backend's declared capabilities
(pipeserve/engine/executor/select.py), and one blocking readback per steady-state step, counted on
the CPU through the runner's one readback helper (executor/buffers.py)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from pipeserve.config import EngineConfig
from pipeserve.engine import LLM, SamplingParams
from pipeserve.engine.backend import get_backend, native
from pipeserve.engine.executor.select import StepPlan, choose, compiled_mode
from tests.conftest import TEST_DEVICE

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_config_maps_the_older_switches():
    assert EngineConfig().step_executor == "auto" and EngineConfig().max_cuda_graph_batch == 256
    assert EngineConfig(compile=False).step_executor == "eager"
    assert EngineConfig(backend="torch").backend == "cpu"  # the cpu backend's former name
    with pytest.raises(ValueError, match="contradicts"):
        EngineConfig(compile=False, step_executor="native")
    with pytest.raises(ValueError, match="step_executor"):
        EngineConfig(step_executor="graphs")


def test_compiled_mode_by_backend_and_device(monkeypatch):
    assert compiled_mode(get_backend("cpu"), CPU)[0] == "inductor"
    assert compiled_mode(get_backend("triton"), CUDA)[0] == "cuda-graph"
    assert compiled_mode(get_backend("cpu"), CUDA)[0] is None  # its host-side memos cannot be captured
    assert compiled_mode(get_backend("triton"), CPU)[0] is None  # the Triton interpreter
    assert compiled_mode(get_backend("reference"), CPU)[0] is None  # the oracle stays eager
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert "C++ compiler" in compiled_mode(get_backend("cpu"), CPU)[1]


def model_and_pool(model_dir: str, **options):
    engine = LLM(model_dir, device="cpu", dtype="float32", step_executor="eager", max_num_seqs=2,
                 **options).engine
    return engine.model, engine.pool


def test_choice_follows_request_and_capabilities(tiny_model):
    model, pool = model_and_pool(tiny_model("llama"))
    plan = {r: StepPlan(requested=r, max_rows=2) for r in ("auto", "eager", "compiled", "native")}
    cpu = get_backend("cpu")
    expected = {"auto": "native", "eager": "eager", "compiled": "inductor", "native": "native"}
    assert {r: choose(p, cpu, model, pool, CPU)[0] for r, p in plan.items()} == expected
    ref_model, ref_pool = model_and_pool(tiny_model("llama"), backend="reference")
    assert choose(plan["auto"], get_backend("reference"), ref_model, ref_pool, CPU)[0] == "eager"
    assert choose(plan["auto"], get_backend("triton"), model, pool, CUDA)[0] == "cuda-graph"
    tp = StepPlan(requested="auto", max_rows=2, tensor_parallel=True)
    assert choose(tp, cpu, model, pool, CPU)[0] == "eager"
    with pytest.raises(ValueError, match="compiled"):
        choose(plan["compiled"], get_backend("reference"), ref_model, ref_pool, CPU)
    with pytest.raises(ValueError, match="native"):
        choose(plan["native"], get_backend("triton"), model, pool, CUDA)


def count_host_reads(monkeypatch) -> dict[str, int]:
    """Counts tensor-to-host conversions outside the readback helper (which reads with .cpu()). The
    cpu backend's own ops are exempt: they read host tensors (chunk lengths) by design, and never
    run on CUDA, where the Triton backend does."""
    counts = {"other": 0}
    for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if not caller.endswith(os.path.join("backend", "cpu.py")):
                counts["other"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


@pytest.mark.device
@pytest.mark.parametrize("executor", ["auto", "eager"])
@pytest.mark.parametrize("speculative", [None, "ngram", "draft"])
def test_one_readback_per_steady_state_step(stories_dir, monkeypatch, executor, speculative):
    """Decode steps with logprobs, min_tokens, penalties and sampling (and speculation: n-gram, or a
    draft model with a greedy and a sampled request speculating) each read the device once, through
    the helper; nothing else converts a tensor to host values, and a draft model's rounds read nothing."""
    spec = {}
    if speculative == "ngram":
        spec = dict(speculative_method="ngram", prompt_lookup_min=1, speculative_adaptive=False)
    elif speculative == "draft":
        spec = dict(speculative_method="draft", draft_model=stories_dir, num_speculative_tokens=3,
                    speculative_adaptive=False)
    llm = LLM(stories_dir, device=TEST_DEVICE, dtype="float32", step_executor=executor, max_num_seqs=4,
              **spec)
    engine = llm.engine
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, seed=1, logprobs=3, min_tokens=30),
              SamplingParams(max_tokens=40, temperature=0.7, seed=2, repetition_penalty=1.2,
                             presence_penalty=0.5),
              SamplingParams(max_tokens=40, temperature=0.9, seed=3, ignore_eos=True)]
    prompts = [[1, 403, 407, 261, 403, 407, 261, 403], [1, 500, 301], [1, 30, 31, 32],
               [1, 403, 407, 261, 403]]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add(str(i), prompt, p)
    for _ in range(3):  # prefill and the first decode steps (admissions)
        engine.step()
    drafter = engine.speculator.draft if engine.speculator is not None else None
    counts = count_host_reads(monkeypatch)
    before, steps = engine.runner.buffers.readbacks, 0
    draft_before = drafter.runner.buffers.readbacks if drafter is not None else 0
    while len(engine.scheduler.running) == 4 and steps < 10:
        engine.step()
        steps += 1
    assert steps >= 5
    assert engine.runner.buffers.readbacks - before == steps
    assert counts["other"] == 0
    if speculative:
        stats = engine.stats()
        assert stats["spec_verifications"] > 0
    if drafter is not None:  # its own model as the draft: proposals are accepted, never read apart
        assert drafter.runner.buffers.readbacks == draft_before
        assert stats["spec_accepted_tokens"] > 0


@pytest.mark.device
def test_prompt_logprob_steps_read_back_once(stories_dir):
    """Steps that score prompt logprobs (chunks beside a decoding request, the last one sampling)
    bring the scores back in the step's one readback."""
    llm = LLM(stories_dir, device=TEST_DEVICE, dtype="float32", max_num_seqs=2, max_num_batched_tokens=8)
    engine = llm.engine
    engine.add("0", [1, 30, 31], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.step()
    prompt = list(range(100, 120))
    engine.add("1", prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    seq = engine.scheduler.waiting[0]
    before = engine.runner.buffers.readbacks
    for _ in range(3):  # 20 prompt tokens in chunks of 7, 7 and 6 beside the decode row
        engine.step()
    assert engine.runner.buffers.readbacks - before == 3
    assert seq.prompt_logprobs is not None and not np.isnan(seq.prompt_logprobs.logprobs[1:]).any()
