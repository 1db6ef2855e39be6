"""--rope-scaling: an explicit rope_scaling override lets --max-model-len go past the context the model
was trained for (as vLLM allows it), and the engine then runs exactly the override: greedy tokens
equal transformers' with the same rope_scaling. Without it such a --max-model-len is refused."""

from __future__ import annotations

import json

import pytest
import torch

from pipeserve.config import EngineConfig
from pipeserve.engine.model.rope import rope_cache
from pipeserve.model_config import model_limits
from pipeserve.preflight import StartupError, resolve
from pipeserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)
LINEAR2 = json.dumps({"rope_type": "linear", "factor": 2.0})


def test_the_override_scales_the_context_the_checks_allow(stories_dir: str) -> None:
    assert model_limits(stories_dir).context_len == 512
    assert model_limits(stories_dir, LINEAR2).context_len == 1024
    ok = resolve(EngineConfig(model=stories_dir, max_model_len=1024, rope_scaling=LINEAR2))
    assert ok.max_model_len == 1024 and ok.rope_scaling == LINEAR2
    with pytest.raises(StartupError, match="above the 1024 tokens --rope-scaling scales"):
        resolve(EngineConfig(model=stories_dir, max_model_len=1025, rope_scaling=LINEAR2))
    with pytest.raises(StartupError, match=r"trained for \(512 tokens\).*scale the context with --rope"):
        resolve(EngineConfig(model=stories_dir, max_model_len=1024))


@pytest.mark.parametrize(("text", "match"), [
    ("linear", "rope_scaling is not JSON"),
    ('{"rope_type": "yarn", "factor": 2}', "rope_type of linear or llama3"),
    ('{"rope_type": "linear"}', "factor >= 1"),
    ('{"rope_type": "llama3", "factor": 8}', "llama3 needs low_freq_factor"),
])
def test_overrides_the_engine_cannot_run_are_refused(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(rope_scaling=text)


def test_the_engine_serves_the_scaled_context_as_transformers_runs_it(stories_dir: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pipeserve.engine import LLM

    llm = LLM(stories_dir, device="cpu", rope_scaling=LINEAR2, max_model_len=1024, num_pages=128)
    engine = llm.engine
    assert engine.max_model_len == 1024 and engine.model_info()["context_length"] == 1024
    expected_table = rope_cache(8, 1024, 10000.0, json.loads(LINEAR2))
    assert torch.equal(engine.model.cos_sin, expected_table)

    config = AutoConfig.from_pretrained(stories_dir)
    if hasattr(config, "rope_parameters"):  # transformers >= 5 reads the scaling from here
        config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    else:
        config.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    hf = AutoModelForCausalLM.from_pretrained(stories_dir, config=config, torch_dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(stories_dir)("Once upon a time", return_tensors="pt").input_ids
    want = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    got = llm.generate("Once upon a time", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert got[0].token_ids == want
    plain = LLM(stories_dir, device="cpu", num_pages=128).generate(
        "Once upon a time", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert plain[0].token_ids != want  # the override changed what the model computes
