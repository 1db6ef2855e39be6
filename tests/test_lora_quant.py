"""LoRA adapters over quantized base weights, every --quantization mode: y = quant_base(x) + (x A^T) B,
the adapter's factors in the activations' dtype.

- Exact composition, against Hugging Face PEFT's model with the same adapter over the engine's own
  weights dequantized (W8A8: its inputs quantized per token as the engine's linears do). W4A16 and
  NF4 (float activations): greedy tokens identical (fp32), one adapter at a time and in steps mixing
  adapters and the base. W8A8 INT8 and FP8: teacher-forced log-probs, both adapters and the base in
  one step, since greedy tokens are not a property these have even without adapters: an activation
  code flips on a last-bit difference upstream (HF's rounding, the step's shape: the FP8 base alone
  and in a batch of three differ on one of these prompts, as HF's cached generation differs from
  its full forward), and the rest of that sequence moves by up to a few tenths of a log-prob.
- Accuracy: the quantized model with an adapter (teacher-forced, the engine's prompt logprobs on a
  held-out text) against HF PEFT's float model with that adapter, within the perplexity gates the
  quantized base meets against the float base (tests/test_quant_accuracy.py).
- Eager steps: the native CPU step runs no quantized model, and `auto` would compile these with Inductor
  (tests/test_lora_compiled.py covers that), once per test: these ask for eager steps.
- The Triton path (the interpreter here): quantized GEMMs and the LoRA kernels in whole steps.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from typing import Any

import pytest
import torch
from torch import nn

from pipeserve import LLM, LoRARequest, SamplingParams
from pipeserve.config import QUANTIZATIONS
from pipeserve.engine.backend import get_backend
from pipeserve.engine.lora.layer import LoRALinear
from pipeserve.engine.model.accuracy import story_text, windows
from pipeserve.engine.quantization.linear import W8A8_DTYPES, W4A16Linear, W8A8Linear
from tests.lora_adapters import ALL_LINEAR, ATTENTION, build_adapter, hf_greedy

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("torch_one_thread")]

METHODS = [m for m in QUANTIZATIONS if m != "none"]
TOKEN_EXACT = [m for m in METHODS if m not in W8A8_DTYPES]
# Perplexity increase over the float model allowed per method, %: the gates of tests/test_quant_accuracy.py.
GATES = {"w8a8-int8": 2.0, "w8a8-fp8": 3.0, "w4a16": 15.0, "nf4": 15.0}
N = 10
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
PROMPTS = [[1, 43, 107, 61, 78, 30], [1, 70, 80, 90, 100], [1, 5, 9, 200, 17, 33, 64, 12]]
CPU = get_backend("cpu")


@pytest.fixture(scope="module")
def adapters(stories_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[LoRARequest, Any]]:
    """rank 16 all-linear and rank 8 attention-only (B ~ N(0, 0.03): they change the greedy tokens), and a
    milder rank 16 all-linear one (B ~ N(0, 0.015): perplexity +8.5% on the float model, for the
    accuracy gates): (request, HF PEFT model) each."""
    tmp = str(tmp_path_factory.mktemp("lora-quant"))
    out = []
    specs = [(16, ALL_LINEAR, 0.03), (8, ATTENTION, 0.03), (16, ALL_LINEAR, 0.015)]
    for i, (rank, targets, std) in enumerate(specs):
        path = os.path.join(tmp, f"adapter{i}")
        out.append((LoRARequest(f"adapter{i}", i + 1, path),
                    build_adapter(stories_dir, path, rank, targets, seed=i, std=std)))
    return out


def quantized_llm(stories_dir: str, method: str, **options: Any) -> LLM:
    return LLM(stories_dir, device="cpu", quantization=method, enable_lora=True, max_loras=2,
               max_lora_rank=16, **{"num_pages": 128, "step_executor": "eager", **options})


def tokens(llm: LLM, prompts: list[list[int]], lora: object = None) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, lora_request=lora)]  # type: ignore[arg-type]


def _fake_quant(dtype: torch.dtype):
    """A forward pre-hook: the linear's input quantized per token and back, as a W8A8 linear reads it."""

    def hook(_: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        q, scale = CPU.per_token_quant(x.reshape(-1, x.shape[-1]).contiguous(), dtype)
        return ((q.float() * scale).view_as(x), *args[1:])

    return hook


def _dequantized(module: nn.Module) -> tuple[torch.Tensor, torch.dtype | None]:
    """The fp32 weight a quantized linear of the engine stands for, and the dtype its input is
    quantized to (None: weight-only)."""
    base = module.base if isinstance(module, LoRALinear) else module
    if isinstance(base, W8A8Linear):
        return (base.weight.float() * base.weight_scale.float()[:, None]).cpu(), base.quant_dtype
    assert isinstance(base, W4A16Linear), type(base)
    return base.packed().dequantize().cpu(), None


def dequantized_reference(peft_model: Any, llm: LLM) -> Any:
    """HF PEFT's model with the engine's quantized projections dequantized into its base layers."""
    ref = copy.deepcopy(peft_model)
    cfg = llm.engine.model.config
    sizes = {"qkv_proj": (("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)),
             "gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)),
             "down_proj": (("down_proj", cfg.hidden_size),)}
    hf_layers = ref.base_model.model.model.layers
    for ours, theirs in zip(llm.engine.model.layers, hf_layers, strict=True):
        for fused, parts in sizes.items():
            block = "self_attn" if fused == "qkv_proj" else "mlp"
            weight, act = _dequantized(getattr(getattr(ours, block), fused))
            for (name, _), w in zip(parts, weight.split([size for _, size in parts]), strict=True):
                linear = getattr(getattr(theirs, block), name)
                linear = getattr(linear, "base_layer", linear)  # under PEFT's wrapper, if targeted
                assert isinstance(linear, nn.Linear) and linear.weight.shape == w.shape
                linear.weight.data = w.clone()
                if act is not None:
                    linear.register_forward_pre_hook(_fake_quant(act))
    return ref.eval()


def _check_executor(method: str, records: list[logging.LogRecord]) -> None:
    assert any("step (model): eager (requested" in r.message for r in records)
    if method in W8A8_DTYPES:
        assert any("quantizes its own input" in r.message for r in records)


@pytest.mark.parametrize("method", TOKEN_EXACT)
def test_adapter_over_quantized_weights_matches_peft_on_the_dequantized_model(
        stories_dir: str, adapters, method: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pipeserve"):
        llm = quantized_llm(stories_dir, method)
    assert llm.engine.runner.executor.mode == "eager"
    _check_executor(method, caplog.records)
    refs = []
    for request, peft_model in adapters[:2]:
        ref = hf_greedy(dequantized_reference(peft_model, llm), PROMPTS, N)
        with peft_model.disable_adapter():
            base = hf_greedy(dequantized_reference(peft_model, llm), PROMPTS, N)
        assert ref != base, request.lora_name  # the adapter matters
        assert tokens(llm, PROMPTS, request) == ref, request.lora_name
        refs.append(ref)
    assert tokens(llm, PROMPTS) == base
    # One batch: rows of both adapters and of none in the same steps, each its request's tokens alone.
    prompts, loras, expected = [], [], []
    for j, p in enumerate(PROMPTS):
        for i, request in enumerate([adapters[0][0], adapters[1][0], None]):
            prompts.append(p)
            loras.append(request)
            expected.append(base[j] if request is None else refs[i][j])
    steps = llm.engine.step_count
    assert tokens(llm, prompts, loras) == expected
    assert llm.engine.step_count - steps == N  # one prefill step, N - 1 decode steps: all rows together


def _reference_logprobs(model: Any, seq: list[int]) -> torch.Tensor:
    """log p(seq[i] | seq[:i]) for i >= 1 under a Hugging Face model."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
    return logits.log_softmax(-1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]


def _check_mixed_step_logprobs(llm: LLM, adapters: list[tuple[LoRARequest, Any]], prompts: list[list[int]],
                               n: int, label: str) -> None:
    """Each prompt's greedy continuation of n tokens with adapter 0, adapter 1 and none, then all of
    those sequences scored in one prefill step (prompt log-probs) against the dequantized PEFT
    reference's log-probs: at least 80% within 1e-4, none off by 1, while the adapters move some by
    more than 1."""
    loras: list[LoRARequest | None] = [adapters[0][0], adapters[1][0], None]
    seqs, refs, shift = [], [], 0.0
    for i, lora in enumerate(loras):
        peft_model = adapters[i % 2][1]
        ref_model = dequantized_reference(peft_model, llm)
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                            lora_request=lora)
        for p, out in zip(prompts, [o.token_ids for o in outs], strict=True):
            seqs.append(p + out)
            if lora is None:
                with ref_model.disable_adapter():
                    refs.append(_reference_logprobs(ref_model, p + out))
            else:
                refs.append(_reference_logprobs(ref_model, p + out))
                with ref_model.disable_adapter():
                    moved = _reference_logprobs(ref_model, p + out) - refs[-1]
                shift = max(shift, float(moved.abs().max()))
    steps = llm.engine.step_count
    scored = llm.generate(seqs, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                          lora_request=[lora for lora in loras for _ in prompts])
    assert llm.engine.step_count - steps == 1  # every row of every adapter in one step
    diffs = []
    for out, ref in zip(scored, refs, strict=True):
        ours = torch.tensor([lp["logprob"] for lp in (out.prompt_logprobs or [])[1:] if lp is not None])
        assert ours.shape == ref.shape
        diffs.append((ours - ref).abs())
    diff = torch.cat(diffs)
    exact = float((diff < 1e-4).float().mean())
    print(f"\n{label}: {exact:.1%} of the log-probs within 1e-4 of the reference, worst "
          f"{float(diff.max()):.4f}, the adapters move them by up to {shift:.2f}")
    assert exact >= 0.8 and float(diff.max()) < 1.0 and shift > 1.0


@pytest.mark.parametrize("method", sorted(W8A8_DTYPES))
def test_w8a8_adapter_logprobs_match_peft_on_the_dequantized_model(stories_dir: str, adapters, method: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Both adapters and the base in one prefill step (prompt log-probs, teacher-forced on each
    sequence's own greedy continuation) against the dequantized PEFT reference: most log-probs equal
    to fp32 rounding (measured: all, with these adapters; with B ~ N(0, 0.1) 80-90%, where a code
    flip moved the rest of a sequence by up to 0.46), while the adapters move them by several units."""
    with caplog.at_level(logging.INFO, logger="pipeserve"):
        llm = quantized_llm(stories_dir, method)
    _check_executor(method, caplog.records)
    _check_mixed_step_logprobs(llm, adapters, PROMPTS, N, method)


@pytest.mark.parametrize("method", sorted(W8A8_DTYPES))
def test_unfused_w8a8_inputs_give_the_fused_models_logprobs(stories_dir: str, method: str) -> None:
    """Under --enable-lora each W8A8 linear quantizes its own float input; the codes are the fused
    norm's and activation's, so the base model's log-probs are the engine's without LoRA."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    logprobs = []
    for options in ({"enable_lora": True}, {}):  # eager both: a prefill step, no compile to wait for
        llm = LLM(stories_dir, device="cpu", quantization=method, num_pages=32, step_executor="eager",
                  **options)
        fused = type(llm.engine.model.layers[0].input_layernorm).__name__
        assert fused == ("RMSNorm" if options.get("enable_lora") else "QuantRMSNorm")
        outs = llm.generate(PROMPTS, params)
        logprobs.append(torch.tensor([lp["logprob"] for o in outs for lp in (o.prompt_logprobs or [])[1:]
                                      if lp is not None]))
    torch.testing.assert_close(logprobs[0], logprobs[1], rtol=0, atol=1e-5)


def _engine_perplexity(llm: LLM, seqs: list[list[int]], lora: LoRARequest | None) -> float:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outs = llm.generate(seqs, params, lora_request=lora)
    nll = [-lp["logprob"] for o in outs for lp in (o.prompt_logprobs or [])[1:] if lp is not None]
    assert len(nll) == sum(len(s) - 1 for s in seqs)
    return math.exp(sum(nll) / len(nll))


def _hf_perplexity(model: Any, seqs: list[list[int]]) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            logits = model(input_ids=ids).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += len(s) - 1
    return math.exp(nll / count)


@pytest.fixture(scope="module")
def story_windows(stories_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    ids = tok(story_text(20, seed=1), add_special_tokens=False).input_ids
    return windows(ids, 256, tok.bos_token_id)


@pytest.mark.parametrize("method", METHODS)
def test_teacher_forced_perplexity_with_an_adapter_within_the_quantization_gate(
        stories_dir: str, adapters, story_windows, method: str) -> None:
    """The quantized model with the mild all-linear adapter, teacher-forced, against HF PEFT's float
    model with it: the perplexity rises no more than the quantized base's gate allows."""
    request, peft_model = adapters[2]
    llm = quantized_llm(stories_dir, method, num_pages=256)
    ours = _engine_perplexity(llm, story_windows, request)
    theirs = _hf_perplexity(peft_model, story_windows)
    with peft_model.disable_adapter():
        hf_base = _hf_perplexity(peft_model, story_windows)
    base = _engine_perplexity(llm, story_windows, None)
    delta, base_delta = 100 * (ours / theirs - 1), 100 * (base / hf_base - 1)
    print(f"\n{method:>9}: with the adapter ppl {ours:.4f} vs PEFT {theirs:.4f} ({delta:+.2f}%), base "
          f"{base:.4f} vs HF {hf_base:.4f} ({base_delta:+.2f}%), gate {GATES[method]}%")
    assert abs(theirs / hf_base - 1) > 0.01  # the adapter changes the model measurably
    assert delta <= GATES[method]


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.parametrize("method", ["w8a8-int8", "w4a16"])
def test_triton_backend_adapters_over_quantized_weights(stories_dir: str, adapters, method: str) -> None:
    """The Triton path (the interpreter on the CPU): the quantized GEMMs, then the LoRA shrink/expand
    kernels, in whole engine steps mixing two adapters and the base, against the dequantized PEFT
    reference: its tokens (W4A16), its log-probs (W8A8)."""
    from tests.conftest import TEST_DEVICE

    llm = LLM(stories_dir, device=TEST_DEVICE, backend="triton", dtype="float32", quantization=method,
              enable_lora=True, max_loras=2, max_lora_rank=16, num_pages=32)
    if method in W8A8_DTYPES:  # greedy tokens are not a W8A8 property: log-probs, as above
        # Two new tokens (the interpreter's steps are slow): the scored step still mixes every row.
        _check_mixed_step_logprobs(llm, adapters, PROMPTS[:2], 2, f"triton {method}")
        return
    prompts, loras, expected = [], [], []
    for j, (i, lora) in enumerate([(0, adapters[0][0]), (1, adapters[1][0]), (0, None)]):
        peft_model = adapters[i][1]
        ref = dequantized_reference(peft_model, llm)
        if lora is None:
            with ref.disable_adapter():
                expected.append(hf_greedy(ref, PROMPTS[j:j + 1], 4)[0])
        else:
            expected.append(hf_greedy(ref, PROMPTS[j:j + 1], 4)[0])
        prompts.append(PROMPTS[j])
        loras.append(lora)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, lora_request=loras)] == expected


@pytest.mark.slow
def test_tensor_parallel_adapters_over_4bit_weights(tiny_model, tmp_path) -> None:
    """TP=2 over W4A16 weights (each rank its shard of the 4-bit layers and of the adapters): the
    tokens of TP=1 in steps mixing an adapter and the base (activations stay float, so the ranks'
    partial sums are TP=1's products; W8A8's row-parallel input is quantized over each rank's slice,
    which moves it by quantization error, as without adapters)."""
    model_dir = tiny_model("llama")
    build_adapter(model_dir, str(tmp_path / "a"), 8, ALL_LINEAR)
    request = LoRARequest("a", 1, str(tmp_path / "a"))
    prompts, loras = [[1, 5, 9, 13, 2, 7], [1, 40, 41], [1, 5, 9, 13, 2, 7]], [request, request, None]
    runs = []
    for tp in (1, 2):
        llm = LLM(model_dir, device="cpu", dtype="float32", quantization="w4a16", tensor_parallel_size=tp,
                  enable_lora=True, max_loras=2, step_executor="eager", num_pages=32)
        runs.append(tokens(llm, prompts, loras))
        llm.engine.close()
    assert runs[0] == runs[1] and runs[0][0] != runs[0][2]
