"""Batched multi-LoRA serving, offline (pipeserve/engine/lora): greedy tokens identical to Hugging Face
PEFT's with the same random adapters (stories260K and tiny Llama / Qwen2 / Mistral, rank 8 and 16,
attention-only and all-linear; through the native CPU step and the eager one), steps mixing adapters
and the base, more adapters than slots, the
adapter directory's validation, prefix caching keyed by adapter, speculative decoding with adapters."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from pipeserve import LLM, LoRARequest, SamplingParams
from pipeserve.lora import LoRAError, validate
from tests.lora_adapters import ALL_LINEAR, ATTENTION, build_adapter, hf_greedy

N = 10  # tokens generated per prompt
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
PROMPTS = [[1, 43, 107, 61, 78, 30], [1, 70, 80, 90, 100], [1, 5, 9, 200, 17, 33, 64, 12]]


def reference(model_dir: str, tmp: str, specs: list[tuple[int, list[str], bool]]) -> tuple[
        list[LoRARequest], list[list[list[int]]], list[list[int]]]:
    """Adapters of model_dir (rank, targets, rslora), their HF PEFT greedy tokens on PROMPTS, and the
    base model's."""
    from transformers import AutoModelForCausalLM

    requests, refs = [], []
    for i, (rank, targets, rslora) in enumerate(specs):
        path = os.path.join(tmp, f"adapter{i}")
        model = build_adapter(model_dir, path, rank, targets, seed=i, rslora=rslora)
        refs.append(hf_greedy(model, PROMPTS, N))
        requests.append(LoRARequest(f"adapter{i}", i + 1, path))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return requests, refs, hf_greedy(base, PROMPTS, N)


def tokens(llm: LLM, prompts: list[list[int]], lora: object = None) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, lora_request=lora)]  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def stories_adapters(stories_dir: str, tmp_path_factory: pytest.TempPathFactory):
    tmp = str(tmp_path_factory.mktemp("stories-lora"))
    specs = [(8, ATTENTION, False), (16, ALL_LINEAR, False), (8, ["q_proj", "v_proj"], True),
             (16, ["gate_proj", "down_proj", "o_proj"], False)]
    return reference(stories_dir, tmp, specs)


@pytest.fixture(scope="module")
def tiny_adapters(tiny_model, tmp_path_factory: pytest.TempPathFactory):
    """Factory: kind -> (its model dir, reference(...) of two adapters), built once for both executors."""
    cache: dict[str, tuple[str, tuple[list[LoRARequest], list[list[list[int]]], list[list[int]]]]] = {}

    def make(kind: str):
        if kind not in cache:
            model_dir = tiny_model(kind)
            specs = [(8, ALL_LINEAR, False), (16, ATTENTION, False)]
            cache[kind] = model_dir, reference(model_dir, str(tmp_path_factory.mktemp(f"{kind}-lora")), specs)
        return cache[kind]

    return make


@pytest.mark.parametrize("executor", ["native", "eager"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_matches_peft_tiny_models(kind: str, executor: str, tiny_adapters) -> None:
    model_dir, (requests, refs, base) = tiny_adapters(kind)
    llm = LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=16, num_pages=64,
              step_executor=executor)
    assert llm.engine.runner.executor.mode == executor
    for request, ref in zip(requests, refs, strict=True):
        assert tokens(llm, PROMPTS, request) == ref, request.lora_name
    assert refs[0] != base and refs[1] != base  # the adapters matter
    assert tokens(llm, PROMPTS) == base


@pytest.mark.parametrize("executor", ["native", "eager"])
def test_matches_peft_stories(executor: str, stories_dir: str, stories_adapters) -> None:
    """rank 8 attention-only, rank 16 all-linear, rsLoRA, an MLP+o_proj subset: each alone."""
    requests, refs, base = stories_adapters
    llm = LLM(stories_dir, enable_lora=True, max_loras=2, max_lora_rank=16, num_pages=128,
              step_executor=executor)
    assert llm.engine.runner.executor.mode == executor
    for request, ref in zip(requests, refs, strict=True):
        assert ref != base, request.lora_name
        assert tokens(llm, PROMPTS, request) == ref, request.lora_name
    assert tokens(llm, PROMPTS) == base


def test_one_step_mixes_three_adapters_and_the_base(stories_dir: str, stories_adapters) -> None:
    """Every request of the batch runs in the same steps (four slots, all admitted at once); each row
    gets the tokens of its request alone."""
    requests, refs, base = stories_adapters
    llm = LLM(stories_dir, enable_lora=True, max_loras=4, max_lora_rank=16, num_pages=256)
    assert llm.engine.runner.executor.mode == "native"  # the CPU's step, adapters in it
    prompts, loras, expected = [], [], []
    for j, p in enumerate(PROMPTS):
        for i, request in enumerate([*requests[:3], None]):
            prompts.append(p)
            loras.append(request)
            expected.append(base[j] if request is None else refs[i][j])
    steps = llm.engine.step_count
    assert tokens(llm, prompts, loras) == expected
    # One prefill step and N - 1 decode steps: every row ran in the same steps.
    assert llm.engine.step_count - steps == N
    assert llm.engine.stats()["lora_swaps"] == 3


def test_more_adapters_than_slots(stories_dir: str, stories_adapters) -> None:
    """Four adapters through two slots: every request completes with its adapter's tokens, the
    requests that find no slot wait without holding back the base requests, and swaps are counted."""
    requests, refs, base = stories_adapters
    llm = LLM(stories_dir, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=4, num_pages=256)
    assert llm.engine.runner.executor.mode == "native"
    prompts, loras, expected = [], [], []
    for j, p in enumerate(PROMPTS):
        for i, request in enumerate([*requests, None]):
            prompts.append(p)
            loras.append(request)
            expected.append(base[j] if request is None else refs[i][j])
    assert tokens(llm, prompts, loras) == expected
    stats = llm.engine.stats()
    assert stats["lora_swaps"] >= 4 and stats["running"] == 0
    assert not any(k.startswith("lora_running:") for k in stats)


def test_host_cache_evicts_least_recently_used(stories_dir: str, stories_adapters) -> None:
    requests, refs, _ = stories_adapters
    llm = LLM(stories_dir, enable_lora=True, max_loras=1, max_lora_rank=16, max_cpu_loras=1, num_pages=64)
    for request, ref in zip(requests[:2] * 2, refs[:2] * 2, strict=True):
        assert tokens(llm, PROMPTS[:1], request) == ref[:1]
    assert llm.engine.lora is not None
    assert llm.engine.lora.host.loads == 4  # one in memory: each switch read the other from disk
    assert list(llm.engine.lora.host.adapters) == [requests[1].lora_int_id]


def test_prefix_cache_is_keyed_by_adapter(stories_dir: str, stories_adapters) -> None:
    requests, refs, base = stories_adapters
    llm = LLM(stories_dir, enable_lora=True, max_loras=2, max_lora_rank=16, num_pages=64, page_size=2)
    prompt = [PROMPTS[2]]
    first = llm.generate(prompt, GREEDY, lora_request=requests[0])[0]
    other = llm.generate(prompt, GREEDY, lora_request=requests[1])[0]
    plain = llm.generate(prompt, GREEDY)[0]
    again = llm.generate(prompt, GREEDY, lora_request=requests[0])[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, plain.num_cached_tokens) == (0, 0, 0)
    assert again.num_cached_tokens > 0
    assert [first.token_ids, other.token_ids, plain.token_ids, again.token_ids] == [
        refs[0][2], refs[1][2], base[2], refs[0][2]]


def test_speculative_decoding_verifies_with_the_adapter(stories_dir: str, stories_adapters) -> None:
    """n-gram proposals (made without the adapter) are verified by the model with it: the tokens are
    the adapter's greedy tokens."""
    requests, refs, _ = stories_adapters
    llm = LLM(stories_dir, enable_lora=True, max_loras=2, max_lora_rank=16, num_pages=128,
              speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False)
    assert tokens(llm, PROMPTS, requests[1]) == refs[1]
    assert llm.engine.stats()["spec_verifications"] > 0


def test_structured_outputs_with_adapters(stories_dir: str, stories_adapters) -> None:
    """Constrained requests with an adapter, with none and an unconstrained one with an adapter, in one
    batch: every constrained text matches its constraint, the unconstrained request keeps the
    adapter's greedy tokens."""
    import re

    requests, refs, _ = stories_adapters
    llm = LLM(stories_dir, enable_lora=True, max_loras=2, max_lora_rank=16, num_pages=128)
    pattern = "[0-9]{3}-[a-z]{2,5}"
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=3, regex=pattern),
              SamplingParams(max_tokens=16, temperature=1.0, seed=4, regex=pattern),
              SamplingParams(max_tokens=8, temperature=0.0, choice=["yes", "no", "maybe"]),
              GREEDY]
    outs = llm.generate(["Once upon a time", "The cat", "Is the sky blue?", PROMPTS[0]], params,
                        lora_request=[requests[0], None, requests[1], requests[0]])
    assert all(re.fullmatch(pattern, o.text) for o in outs[:2]), [o.text for o in outs[:2]]
    assert outs[2].text in ("yes", "no", "maybe")
    assert outs[3].token_ids == refs[0][0]


def test_refused_combinations() -> None:
    from pipeserve.config import EngineConfig

    assert EngineConfig(enable_lora=True, quantization="w8a8-int8").quantization == "w8a8-int8"  # served
    with pytest.raises(ValueError, match="need enable_lora"):
        EngineConfig(lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="NAME=PATH"):
        EngineConfig(enable_lora=True, lora_modules=["nopath"])
    assert EngineConfig(enable_lora=True, max_loras=2).max_cpu_loras == 4
    assert EngineConfig(enable_lora=True, max_loras=8).max_cpu_loras == 8


def test_offline_errors(stories_dir: str, stories_adapters, tmp_path) -> None:
    requests, _, _ = stories_adapters
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(stories_dir, num_pages=16).generate(PROMPTS[:1], GREEDY, lora_request=requests[0])
    llm = LLM(stories_dir, enable_lora=True, max_lora_rank=8, num_pages=16)
    with pytest.raises(LoRAError, match="rank"):  # rank 16 above max_lora_rank 8
        llm.generate(PROMPTS[:1], GREEDY, lora_request=requests[1])
    with pytest.raises(LoRAError, match="adapter_config.json"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=[requests[0], None])
    assert not llm.engine.has_work()  # nothing was added
    assert tokens(llm, PROMPTS[:1], requests[0]) == stories_adapters[1][0][:1]


def broken(src: str, dst: str, edit: dict | None = None, remove: str | None = None) -> str:
    shutil.copytree(src, dst)
    if edit is not None:
        path = os.path.join(dst, "adapter_config.json")
        with open(path) as f:
            config = json.load(f)
        config.update(edit)
        with open(path, "w") as f:
            json.dump(config, f)
    if remove is not None:
        os.remove(os.path.join(dst, remove))
    return dst


def test_validation_names_the_file_and_field(stories_adapters, tmp_path) -> None:
    src = stories_adapters[0][0].lora_path
    cases = [
        ({"remove": "adapter_config.json"}, "adapter_config.json is missing"),
        ({"remove": "adapter_model.safetensors"}, "adapter_model.safetensors is missing"),
        ({"edit": {"r": 32}}, "rank r=32 is above max_lora_rank=16"),
        ({"edit": {"target_modules": ["q_proj", "lm_head"]}}, "target_modules"),
        ({"edit": {"lora_alpha": "big"}}, "lora_alpha"),
        ({"edit": {"use_rslora": "yes"}}, "use_rslora"),
        ({"edit": {"use_dora": True}}, "use_dora"),
        ({"edit": {"r": 4}}, "factor rank 8 is not adapter_config.json's r=4"),
    ]
    for i, (how, message) in enumerate(cases):
        with pytest.raises(LoRAError, match=message):
            validate(broken(src, str(tmp_path / str(i)), **how), 16)
    with pytest.raises(LoRAError, match="does not exist"):
        validate(str(tmp_path / "nowhere"), 16)
    config, _ = validate(src, 16)
    assert (config.rank, config.scale, config.target_modules) == (8, 2.0, tuple(sorted(ATTENTION)))


@pytest.mark.slow
def test_triton_backend_matches_peft(stories_dir: str, stories_adapters) -> None:
    """The Triton kernels (under the interpreter on the CPU) in whole engine steps: prefill segments
    (SGMV) and decode rows (BGMV) of several adapters and the base."""
    requests, refs, base = stories_adapters
    llm = LLM(stories_dir, enable_lora=True, max_loras=2, max_lora_rank=16, num_pages=64, backend="triton",
              dtype="float32")
    prompts = PROMPTS[:2] * 2
    loras = [requests[0], requests[1], None, requests[1]]
    expected = [refs[0][0], refs[1][1], base[0], refs[1][1]]
    assert tokens(llm, prompts, loras) == expected
