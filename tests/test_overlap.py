"""Overlapped decode steps (EngineConfig.overlap_steps): each call launches its step, then reads the
step in flight. Run on the CPU here, where the logic is the same as on CUDA: every request's tokens
equal the synchronous engine's through admissions, preemption, prefix-cache hits, stops, logprobs,
penalties and aborts; a step's input ids come from the device while the host holds PENDING; one
readback per step; no page is hashed over a PENDING token."""

from __future__ import annotations

import random

import pytest

from pipeserve.config import EngineConfig
from pipeserve.engine.engine import Engine
from pipeserve.engine.llm import LLM
from pipeserve.engine.sequence import PENDING
from pipeserve.sampling_params import SamplingParams
from tests.conftest import TEST_DEVICE

from .test_engine import drain

# On CUDA ($PIPESERVE_TEST_DEVICE=cuda) the steps really overlap: the device runs one while the host
# schedules the next. fp32, so that the two modes' kernels give the same tokens.
pytestmark = pytest.mark.device


def engine(stories_dir: str, mode: str, **options) -> Engine:
    opts = dict(device=TEST_DEVICE, dtype="float32", page_size=4, num_pages=64, max_num_batched_tokens=16)
    return LLM(stories_dir, overlap_steps=mode, **{**opts, **options}).engine


def workload(eng: Engine, seed: int) -> dict[str, tuple[list[int], str]]:
    """Requests arriving while others decode (some mid-flight), mixed lengths, stops, logprobs,
    penalties and seeded sampling, two aborts; rid -> (tokens, finish reason)."""
    rng = random.Random(seed)
    out: dict[str, tuple[list[int], str]] = {}
    arrivals = {step: [] for step in range(40)}
    for i in range(14):
        arrivals[rng.randrange(0, 40)].append(i)
    aborts = {rng.randrange(5, 40): f"r{rng.randrange(14)}" for _ in range(2)}
    for step in range(10_000):
        for i in arrivals.get(step, []):
            prompt = [1] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 12))]
            params = SamplingParams(max_tokens=rng.randrange(1, 30), temperature=rng.choice([0.0, 0.9]),
                                    seed=i, logprobs=rng.choice([None, 2]),
                                    repetition_penalty=rng.choice([1.0, 1.3]), stop_token_ids=[13])
            eng.add(f"r{i}", prompt, params)
        if step in aborts:
            eng.abort(aborts[step])
        if step > 40 and not eng.has_work():
            return out
        for u in eng.step():
            toks, reason = out.get(u.rid, ([], ""))
            lps = [lp.logprob for lp in u.logprobs or []]
            out[u.rid] = (toks + u.token_ids + [round(x, 4) for x in lps], u.finish_reason or reason)
    raise AssertionError("engine did not go idle")


@pytest.mark.parametrize("pool", [{}, {"num_pages": 14}], ids=["roomy", "preempting"])
def test_overlapped_steps_give_the_synchronous_tokens(stories_dir, pool):
    sync, overlapped = engine(stories_dir, "off", **pool), engine(stories_dir, "on", **pool)
    assert not sync.overlap and overlapped.overlap
    for seed in range(3):
        got, want = workload(overlapped, seed), workload(sync, seed)
        assert got.keys() == want.keys()
        for rid, (toks, reason) in got.items():
            if reason == "abort":  # the abort lands a step later in the token stream: one fewer token
                assert want[rid][1] == "abort" and toks == want[rid][0][: len(toks)]
            else:
                assert (toks, reason) == want[rid], rid
    if pool:
        assert overlapped.scheduler.num_preemptions > 0
    stats = overlapped.stats()
    assert stats["pages_used"] == 0 and stats["requests"] == 0 and not overlapped.has_work()


def test_decode_rows_take_their_input_ids_from_the_device(stories_dir):
    eng = engine(stories_dir, "on")
    for i in range(3):
        eng.add(f"d{i}", [1, 403 + i, 407], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    tokens = {u.rid: list(u.token_ids) for u in eng.step()}  # the prefills: read back at once
    reads = eng.runner.buffers.readbacks
    for step in range(6):
        for u in eng.step():
            tokens.setdefault(u.rid, []).extend(u.token_ids)
        # One readback per call, the last call's step (the first decode step lands with the second
        # call); the step just launched is in flight: its tokens are PENDING.
        assert eng.runner.buffers.readbacks == reads + step
        assert all(seq.token_ids[-1] == PENDING for seq in eng.scheduler.running)
    drain(eng)
    reference = engine(stories_dir, "off")
    for i in range(3):
        reference.add(f"d{i}", [1, 403 + i, 407], SamplingParams(max_tokens=12, temperature=0.0,
                                                                ignore_eos=True))
    assert {rid: toks[:6] for rid, toks in tokens.items()} == {
        rid: toks[:6] for rid, (toks, _) in drain(reference).items()}


def test_pages_are_hashed_only_over_tokens_read(stories_dir):
    """A page filled by a PENDING token is published once the token is read: a later request whose
    prompt is that request's whole text hits the cache as far as with synchronous steps."""
    hits = {}
    for mode in ("off", "on"):
        eng = engine(stories_dir, mode)
        eng.add("a", [1, 403, 407, 261], SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True))
        a = eng.requests["a"]
        drain(eng)
        assert PENDING not in a.token_ids
        before = eng.scheduler.prefix_cache_hits
        eng.add("b", a.token_ids + [5], SamplingParams(max_tokens=2, temperature=0.0))
        drain(eng)
        hits[mode] = eng.scheduler.prefix_cache_hits - before
    assert hits["on"] == hits["off"] == 24


def test_overlap_choice(stories_dir):
    # On by default where the device is not the host: the CPU is, and has nothing to overlap.
    assert engine(stories_dir, "auto").overlap == (TEST_DEVICE == "cuda")
    with pytest.raises(ValueError, match="overlap-steps on"):
        EngineConfig(overlap_steps="on", speculative_method="ngram")
    with pytest.raises(ValueError, match="overlap-steps on"):
        EngineConfig(overlap_steps="on", tensor_parallel_size=2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_server_with_overlapped_steps_streams_the_offline_text(stories_dir, tmp_path):
    """`pipeserve up --overlap-steps on`: concurrent gRPC streams and an HTTP completion give the text
    of the synchronous offline engine, tokens reported a step late through the whole pipeline."""
    import asyncio
    import json
    import urllib.request

    from pipeserve.gateway.client import AsyncClient
    from pipeserve.local_cluster import LocalCluster

    prompts = ["Once upon a time", "The little dog", "Lily went to the park and", "Tom had a red ball"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    want = [o.text for o in LLM(stories_dir, device=TEST_DEVICE, dtype="float32",
                                overlap_steps="off").generate(prompts, greedy)]

    async def streams(target: str) -> list[str]:
        async with AsyncClient(target) as client:
            async def one(prompt: str) -> str:
                chunks = [c.text async for c in client.stream(prompt=prompt, max_tokens=24, temperature=0.0)]
                return "".join(chunks)
            return list(await asyncio.gather(*(one(p) for p in prompts)))

    def http(url: str, prompt: str) -> str:
        body = {"model": "stories", "prompt": prompt, "max_tokens": 24, "temperature": 0.0}
        request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return str(json.loads(response.read())["choices"][0]["text"])

    flags = ("--overlap-steps", "on", "--dtype", "float32", "--served-model-name", "stories")
    with LocalCluster(tmp_path / "up.log", stories_dir, *flags, workers=1, device=TEST_DEVICE,
                      startup=120) as cluster:
        assert asyncio.run(streams(cluster.target)) == want
        assert http(cluster.http_url, prompts[2]) == want[2]
        assert "overlapped decode steps: requested" in (tmp_path / "up.log").read_text()
