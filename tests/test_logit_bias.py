"""logit_bias: the sampler adds each row's biases in one scatter-add over the step's rows (+100 forces
a token, -100 bans one, rows without a bias are untouched, mixed batches), the parameter's
validation, its wire form, and each edge that takes it (HTTP completions and chat, gRPC, offline)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from pipeserve.engine.sampler import Sampler
from pipeserve.gateway.grpc_api import sampling_fields
from pipeserve.gateway.pb import generation_pb2 as pb
from pipeserve.messages import TokenizeRequest, decode, encode
from pipeserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from tests.test_openai_api import HTTPPipeline

pytestmark = pytest.mark.timeout(120)

V = 32


def _sampler(rows: list[SamplingParams]) -> tuple[Sampler, np.ndarray, torch.Tensor]:
    sampler = Sampler(max_num_seqs=len(rows) + 1, vocab_size=V, device=torch.device("cpu"))
    for slot, params in enumerate(rows):
        sampler.set_request(slot, params, [1, 2, 3], [], [])
    slots = np.arange(len(rows), dtype=np.int64)
    return sampler, slots, torch.from_numpy(slots)


def _logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(0)) * 3


def test_plus_100_forces_minus_100_bans_and_unbiased_rows_are_unchanged():
    logits = _logits(4)
    best = logits.argmax(-1)
    target = int((best[0] + 5) % V)
    rows = [
        SamplingParams(temperature=0.0, logit_bias={target: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={int(best[1]): -100.0}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3, logit_bias={target: 100.0}),
    ]
    sampler, slots, slots_t = _sampler(rows)
    tokens = sampler.sample(logits, slots, slots_t).tokens.tolist()
    second = int(logits[1].topk(2).indices[1])
    assert tokens == [target, second, int(best[2]), target]


def test_a_batch_without_biases_samples_as_before_and_a_freed_slot_forgets_its_bias():
    logits = _logits(2)
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=9)]
    reference = _sampler(plain)
    before = reference[0].sample(logits, reference[1], reference[2]).tokens.tolist()
    sampler, slots, slots_t = _sampler([SamplingParams(temperature=0.0, logit_bias={7: 100.0}), plain[1]])
    assert sampler.sample(logits, slots, slots_t).tokens.tolist()[0] == 7
    sampler.free(0)
    sampler.set_request(0, plain[0], [1], [], [])
    sampler.set_request(1, plain[1], [1], [], [])
    assert sampler.sample(logits, slots, slots_t).tokens.tolist() == before
    # A step where another row is biased adds every row's entries: the reused slot must add none.
    ban = int(logits[1].argmax())
    sampler.set_request(1, SamplingParams(temperature=0.0, logit_bias={ban: -100.0}), [1], [], [])
    tokens = sampler.sample(logits, slots, slots_t).tokens.tolist()
    assert tokens[0] == before[0] and tokens[1] != ban


def test_many_biases_widen_the_buffers_for_every_row():
    logits = _logits(2)
    banned = {t: -100.0 for t in range(V - 1)}  # all but the last token, wider than the first buffers
    rows = [SamplingParams(temperature=0.0, logit_bias={3: 50.0}), SamplingParams(temperature=0.0)]
    sampler, slots, slots_t = _sampler(rows)
    sampler.set_request(1, SamplingParams(temperature=0.0, logit_bias=banned), [1], [], [])
    assert sampler.bias_ids.shape[1] >= V - 1
    assert sampler.sample(logits, slots, slots_t).tokens.tolist() == [3, V - 1]


def test_processed_logits_carry_the_bias():
    sampler, slots, slots_t = _sampler([SamplingParams(temperature=1.0, seed=1, logit_bias={4: 2.5})])
    logits = _logits(1)
    out = sampler.processed_logits(logits, slots, slots_t, torch.zeros(1, dtype=torch.int64))
    assert torch.allclose(out[0, 4] - logits[0, 4], torch.tensor(2.5))
    assert torch.equal(out[0, :4], logits[0, :4])


@pytest.mark.parametrize(
    "bias, why",
    [
        ({V: 1.0}, "outside the vocabulary"),
        ({-1: 1.0}, "outside the vocabulary"),
        ({3: 100.5}, r"\[-100, 100\]"),
        ({3: float("nan")}, r"\[-100, 100\]"),
        ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, "at most"),
    ],
)
def test_validation_names_logit_bias(bias, why):
    with pytest.raises(ValueError, match=f"logit_bias.*{why}"):
        SamplingParams(logit_bias=bias).validate(vocab_size=V if len(bias) <= MAX_LOGIT_BIAS else 10**6)


def test_the_wire_keeps_integer_token_ids():
    msg = TokenizeRequest(rid="r", sampling=SamplingParams(logit_bias={5: -100.0, 31: 2.5}), prompt="x")
    back = decode(encode(msg))
    assert isinstance(back, TokenizeRequest) and back.sampling.logit_bias == {5: -100.0, 31: 2.5}


def test_grpc_request_field():
    request = pb.GenerateRequest(prompt="x", logit_bias={5: -100.0, 7: 1.5})
    assert sampling_fields(request)["logit_bias"] == {5: -100.0, 7: 1.5}
    assert "logit_bias" not in sampling_fields(pb.GenerateRequest(prompt="x"))


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    pipeline = HTTPPipeline(str(tmp_path_factory.mktemp("bias")))
    yield pipeline
    pipeline.close()


ENDPOINTS = [
    ("/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.mark.parametrize("path, body", ENDPOINTS)
def test_http_bias_arrives_as_token_ids(api, path, body):
    body = body | {"logit_bias": {"5": 100, "17": -100}}
    future = api.call(httpx.post, api.url + path, json=body, timeout=10)
    request = api.next_request()
    assert request.sampling.logit_bias == {5: 100.0, 17: -100.0}
    api.serve([("a", [5], "stop")], request.rid)
    assert future.result(10).status_code == 200


@pytest.mark.parametrize("bias", [{"512": 1}, {"-1": 1}, {"5": 101}, {"5": -100.5}, {"five": 1}])
@pytest.mark.parametrize("path, body", ENDPOINTS)
def test_http_invalid_bias_is_400_naming_logit_bias(api, path, body, bias):
    response = httpx.post(api.url + path, json=body | {"logit_bias": bias}, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "logit_bias" and "logit_bias" in error["message"]
    assert api.tokenize.poll(50) == 0  # nothing reached the pipeline


@pytest.fixture(scope="module")
def llm(stories_dir):
    from pipeserve.engine.llm import LLM

    return LLM(stories_dir, max_num_seqs=4, max_model_len=256, device="cpu")


def test_offline_greedy_forced_banned_and_mixed(llm):
    prompt = "Once upon a time"
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    (plain,) = llm.generate(prompt, greedy)
    first = plain.token_ids[0]
    forced_id = 400 if first != 400 else 401
    forced = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={forced_id: 100.0}, ignore_eos=True)
    banned = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={first: -100.0})
    # One batch: a forced row, a banned row and an unbiased row step together.
    out_forced, out_banned, out_plain = llm.generate([prompt] * 3, [forced, banned, greedy])
    assert out_forced.token_ids == [forced_id] * 6
    assert first not in out_banned.token_ids
    assert out_plain.token_ids == plain.token_ids
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(prompt, SamplingParams(logit_bias={llm.engine.model_config.vocab_size: 1.0}))


def test_generate_cli_flag_builds_the_grpc_field():
    import argparse

    from pipeserve.gateway.client import add_arguments, build_request

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["hi", "--logit-bias", "5=100", "--logit-bias", "9=-2.5"])
    assert dict(args.logit_bias) == {5: 100.0, 9: -2.5}
    assert dict(build_request("hi", logit_bias=dict(args.logit_bias)).logit_bias) == {5: 100.0, 9: -2.5}
    with pytest.raises(SystemExit):
        parser.parse_args(["hi", "--logit-bias", "5"])


def test_build_request_from_params():
    from pipeserve.gateway.client import build_request

    request = build_request("hi", params=SamplingParams(logit_bias={3: 1.5}))
    assert dict(request.logit_bias) == {3: 1.5}
    assert not build_request("hi", params=SamplingParams()).logit_bias
    with pytest.raises(ValueError, match="reasoning_format is set by the server"):
        build_request("hi", params=SamplingParams(reasoning_format="qwen3"))
