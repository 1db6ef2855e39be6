"""Embeddings: prefill-only engine requests answered with the final-norm hidden state of the last
token, L2-normalised. Checked against Hugging Face on stories260K and a tiny random Llama, chunked
and batched with generation, through the detokenizer's pass-through, and (slow) over HTTP with the
`openai` client and over gRPC's Embed on a real `pipeserve up`."""

from __future__ import annotations

import base64
import inspect

import numpy as np
import pytest
import torch

from pipeserve.detokenizer.worker import Detokenizer, Row
from pipeserve.engine.llm import LLM
from pipeserve.messages import (
    DetokenizeRequest,
    NewRequestInfo,
    StepOutput,
    TextDeltas,
    decode,
    encode,
    pack_floats,
    pack_ids,
    unpack_floats,
)
from pipeserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["Once upon a time", "The cat sat on the mat and looked at the bird", "Lily liked " * 20, "Hi"]


def hf_embeddings(model_dir: str, prompts: list[list[int]], pooling: str = "last") -> list[np.ndarray]:
    """The reference: Hugging Face's last hidden state (after the final norm) at the last token, or
    averaged over every token (mean), L2-normalised."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for ids in prompts:
            states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            hidden = states[-1] if pooling == "last" else states.mean(0)
            out.append(torch.nn.functional.normalize(hidden, dim=-1).numpy())
    return out


def assert_close(ours: list[np.ndarray], reference: list[np.ndarray]) -> None:
    assert len(ours) == len(reference)
    for a, b in zip(ours, reference, strict=True):
        assert a.dtype == np.float32 and a.shape == b.shape
        assert np.abs(a - b).max() < 1e-4
        assert float(a @ b) > 0.9999
        assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-5


@pytest.fixture(scope="module")
def stories(stories_dir):
    # A small token budget: the longer prompts are prefilled in several chunks.
    return LLM(stories_dir, max_num_seqs=64, max_model_len=256, device="cpu", max_num_batched_tokens=32)


def test_stories_matches_hugging_face_chunked(stories, stories_dir):
    ids = [stories.tokenizer(p).input_ids for p in PROMPTS]
    assert max(map(len, ids)) > 32  # chunked
    assert_close(stories.embed(PROMPTS), hf_embeddings(stories_dir, ids))
    assert_close(stories.embed(ids), hf_embeddings(stories_dir, ids))  # token ids as given


def test_tiny_llama_matches_hugging_face(tiny_model):
    model = tiny_model("llama")
    llm = LLM(model, max_num_seqs=8, max_model_len=128, device="cpu")
    rng = np.random.default_rng(0)
    vocab = llm.engine.model_config.vocab_size
    ids = [rng.integers(0, vocab, size=n).tolist() for n in (1, 5, 17, 40)]
    assert_close(llm.embed(ids), hf_embeddings(model, ids))


def test_a_batch_of_64_runs_in_a_few_steps_and_keeps_no_pages(stories_dir):
    llm = LLM(stories_dir, max_num_seqs=64, max_model_len=256, device="cpu", max_num_batched_tokens=2048)
    prompts = [f"Story number {i} begins with a dog" for i in range(64)]
    before = llm.engine.step_count
    vectors = llm.embed(prompts)
    assert len(vectors) == 64 and llm.engine.step_count - before <= 2
    assert llm.engine.pool.stats().pages_used == 0
    reference = llm.embed(prompts[:3])  # alone: the same vectors
    for a, b in zip(vectors[:3], reference, strict=True):
        assert np.abs(a - b).max() < 1e-5


def test_embedding_requests_share_steps_with_generation(stories):
    engine = stories.engine
    prompt = stories.tokenizer("Once upon a time").input_ids
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    (alone,) = stories.generate([prompt], greedy)
    engine.add("gen", prompt, SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()  # the generation is decoding when the embeddings arrive
    long = stories.tokenizer(PROMPTS[2]).input_ids
    engine.add("emb-a", long, SamplingParams(max_tokens=1, temperature=0.0), embed=True)
    engine.add("emb-b", prompt, SamplingParams(max_tokens=1, temperature=0.0), embed=True)
    tokens, vectors, finishes = [], {}, {}
    while engine.has_work():
        for update in engine.step():
            if update.rid == "gen":
                tokens += update.token_ids
            else:
                assert update.token_ids == [] and update.new
                vectors[update.rid], finishes[update.rid] = update.embedding, update.finish_reason
    assert tokens == alone.token_ids[1:]
    assert finishes == {"emb-a": "stop", "emb-b": "stop"}
    (ref_a, ref_b) = stories.embed([long, prompt])
    assert np.abs(vectors["emb-a"] - ref_a).max() < 1e-5 and np.abs(vectors["emb-b"] - ref_b).max() < 1e-5


def test_the_detokenizer_passes_the_vector_on(stories):
    detok = Detokenizer(stories.tokenizer)
    vector = np.linspace(-1, 1, 8, dtype=np.float32)
    rows: dict[str, Row] = {}
    detok.handle(DetokenizeRequest(["e"], 3, pack_ids([1, 2, 3])), rows)
    step = StepOutput(step=1, rids=["e"], tokens=pack_ids([-1]), finish=["stop"],
                      new=[NewRequestInfo("e", embedding=pack_floats(vector))])
    detok.handle(decode(encode(step)), rows)  # type: ignore[arg-type]
    deltas = decode(encode(detok.deltas(rows)))
    assert isinstance(deltas, TextDeltas) and deltas.finish == ["stop"] and deltas.text == [""]
    assert deltas.embeddings is not None and np.array_equal(unpack_floats(deltas.embeddings[0]), vector)
    assert detok.requests == {}


# ---- over the wire: a real server ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    from pipeserve.local_cluster import LocalCluster

    directory = tmp_path_factory.mktemp("embeddings")
    with LocalCluster(directory / "server.log", stories_dir, workers=1, startup=180) as cluster:
        yield cluster


@pytest.mark.slow
def test_openai_client_embeddings(server, stories, stories_dir):
    import openai

    ids = [stories.tokenizer(p).input_ids for p in PROMPTS]
    reference = hf_embeddings(stories_dir, ids)
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        one = client.embeddings.create(model="stories260K", input=PROMPTS[0], encoding_format="float")
        assert [d.index for d in one.data] == [0] and one.object == "list"
        assert_close([np.asarray(one.data[0].embedding, dtype=np.float32)], reference[:1])
        assert one.usage.prompt_tokens == len(ids[0]) == one.usage.total_tokens
        # The SDK asks for base64 by default and decodes it.
        many = client.embeddings.create(model="stories260K", input=PROMPTS)
        assert_close([np.asarray(d.embedding, dtype=np.float32) for d in many.data], reference)
        assert many.usage.prompt_tokens == sum(map(len, ids))
        by_ids = client.embeddings.create(model="stories260K", input=ids, encoding_format="float")
        assert_close([np.asarray(d.embedding, dtype=np.float32) for d in by_ids.data], reference)
        single_ids = client.embeddings.create(model="stories260K", input=ids[1], encoding_format="float")
        assert_close([np.asarray(single_ids.data[0].embedding, dtype=np.float32)], reference[1:2])
        for bad, param in (({"dimensions": 16}, "dimensions"), ({"input": []}, "input"),
                           ({"input": [""]}, "input"), ({"input": [[10**6]]}, "input")):
            body = {"model": "stories260K", "input": "x"} | bad
            with pytest.raises(openai.BadRequestError) as info:
                client.post("/embeddings", body=body, cast_to=object)
            assert info.value.body["param"] == param, info.value.body  # type: ignore[index]


@pytest.mark.slow
def test_raw_base64_is_little_endian_float32(server):
    import httpx

    body = {"model": "stories260K", "input": ["Hi", "Once upon a time"], "encoding_format": "base64"}
    response = httpx.post(server.http_url + "/v1/embeddings", json=body, timeout=60).json()
    floats = httpx.post(server.http_url + "/v1/embeddings", json=body | {"encoding_format": "float"},
                        timeout=60).json()
    for packed, plain in zip(response["data"], floats["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(packed["embedding"]), dtype="<f4")
        # The second call's prompts come from the prefix cache: the same vectors to float rounding.
        assert np.abs(decoded - np.asarray(plain["embedding"], dtype=np.float32)).max() < 1e-5


@pytest.mark.slow
def test_grpc_embed(server, stories):
    ids = stories.tokenizer(PROMPTS[1]).input_ids
    response = server.client.embed([PROMPTS[0], ids], request_id="emb-1")
    assert response.request_id == "emb-1" and len(response.embeddings) == 2
    reference = stories.embed([PROMPTS[0], ids])
    assert_close([np.asarray(e.values, dtype=np.float32) for e in response.embeddings], reference)
    assert [e.prompt_tokens for e in response.embeddings] == [len(stories.tokenizer(PROMPTS[0]).input_ids),
                                                              len(ids)]
    assert response.usage.prompt_tokens == sum(e.prompt_tokens for e in response.embeddings)
    import grpc

    with pytest.raises(grpc.RpcError) as info:
        server.client.embed([[10**6]])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_embedding_beside_speculative_verification(stories_dir, monkeypatch):
    """A step that verifies proposals and finishes an embedding reads both back in its one readback."""
    # Fixed proposal sizes: adaptive ones follow measured step times (a loaded machine may pick none).
    llm = LLM(stories_dir, max_num_seqs=8, max_model_len=256, device="cpu", speculative_method="ngram",
              num_speculative_tokens=3, speculative_adaptive=False)
    prompt = llm.tokenizer("Once upon a time there was a girl. Once upon a time there was").input_ids
    (reference,) = llm.embed([prompt])
    (alone,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20))
    engine = llm.engine
    before = engine.stats()["spec_verifications"]
    verify, extras = engine.runner.verifier.verify, []

    def spy(*args, **kwargs):
        bound = inspect.signature(verify).bind(*args, **kwargs)
        extras.append(bound.arguments.get("also", ()))  # the tensors read back beside the verification's
        return verify(*args, **kwargs)

    monkeypatch.setattr(engine.runner.verifier, "verify", spy)
    engine.add("gen", prompt, SamplingParams(temperature=0.0, max_tokens=20))
    vectors, tokens, steps = {}, [], 0
    while engine.has_work():
        steps += 1
        if 2 <= steps <= 12:  # one embedding per step while the generation decodes (and verifies)
            engine.add(f"emb-{steps}", prompt, SamplingParams(max_tokens=1, temperature=0.0), embed=True)
        for update in engine.step():
            if update.embedding is not None:
                vectors[update.rid] = update.embedding
            tokens += update.token_ids if update.rid == "gen" else []
    assert engine.stats()["spec_verifications"] > before
    hidden = engine.model_config.hidden_size
    assert any(t.shape == (1, hidden) for extra in extras for t in extra)  # a vector rode a verification
    assert len(vectors) == 11 and all(np.abs(v - reference).max() < 1e-5 for v in vectors.values())
    assert tokens == alone.token_ids


def test_embedding_beside_prompt_logprobs_in_one_step(stories):
    """A step that reads prompt rows for prompt logprobs and an embedding's last row reads both."""
    engine = stories.engine
    prompt = stories.tokenizer("The dog ran to the park").input_ids
    other = stories.tokenizer("Lily saw a bird").input_ids
    (ref_vector,) = stories.embed([other])
    scored = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    (alone,) = stories.generate([prompt], scored)
    engine.add("scored", prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))
    engine.add("emb", other, SamplingParams(max_tokens=1, temperature=0.0), embed=True)
    first = {u.rid: u for u in engine.step()}  # both are prefilled in this one step
    assert set(first) == {"scored", "emb"}
    assert np.abs(first["emb"].embedding - ref_vector).max() < 1e-5
    lp = first["scored"].prompt_logprobs
    want = [entry["logprob"] for entry in alone.prompt_logprobs[1:]]
    assert np.allclose(lp.logprobs[1:], want, atol=1e-5)
    while engine.has_work():
        engine.step()


def test_no_embed_normalize_returns_the_raw_hidden_state(stories_dir):
    llm = LLM(stories_dir, max_num_seqs=4, max_model_len=256, device="cpu", embed_normalize=False)
    ids = llm.tokenizer(PROMPTS[0]).input_ids
    (vector,) = llm.embed([ids])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32)
    with torch.no_grad():
        raw = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1].numpy()
    assert np.abs(vector - raw).max() < 1e-4 and abs(float(np.linalg.norm(vector)) - 1.0) > 1e-3


@pytest.mark.slow  # a process group of two ranks
def test_tensor_parallel_embeddings_equal_one_rank(stories, stories_dir):
    """Under tensor parallelism rank 0 reads the vectors out of the full hidden state it holds after
    the last all-reduce; the other ranks run the same step (their logits pass included)."""
    ids = [stories.tokenizer(p).input_ids for p in PROMPTS]
    want = stories.embed(ids)
    tp = LLM(stories_dir, device="cpu", dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=32,
             max_model_len=256)
    try:
        engine = tp.engine
        engine.add("gen", ids[0], SamplingParams(temperature=0.0, max_tokens=4))
        engine.step()
        got = tp.embed(ids)  # beside the generation's decode steps
    finally:
        tp.engine.close()
    for a, b in zip(got, want, strict=True):
        assert np.abs(a - b).max() < 1e-4


# ---- mean pooling ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories_mean(stories_dir):
    # As `stories`: the longer prompts are prefilled in several chunks, each chunk's rows summed.
    return LLM(stories_dir, max_num_seqs=64, max_model_len=256, device="cpu", max_num_batched_tokens=32,
               pooling="mean")


def test_mean_pooling_matches_hugging_face_chunked(stories_mean, stories_dir):
    ids = [stories_mean.tokenizer(p).input_ids for p in PROMPTS]
    assert max(map(len, ids)) > 32  # chunked
    reference = hf_embeddings(stories_dir, ids, "mean")
    assert_close(stories_mean.embed(PROMPTS), reference)
    # Again, now that the prompts' pages are in the prefix cache: every row must still run.
    assert_close(stories_mean.embed(ids), reference)
    assert not np.allclose(reference[2], hf_embeddings(stories_dir, ids[2:3])[0], atol=1e-2)  # not last


def test_mean_pooling_batch_of_64_runs_in_a_few_steps(stories_dir):
    llm = LLM(stories_dir, max_num_seqs=64, max_model_len=256, device="cpu", max_num_batched_tokens=2048,
              pooling="mean")
    prompts = [f"Story number {i} begins with a dog" for i in range(64)]
    before = llm.engine.step_count
    vectors = llm.embed(prompts)
    assert len(vectors) == 64 and llm.engine.step_count - before <= 2
    assert llm.engine.pool.stats().pages_used == 0
    ids = [llm.tokenizer(p).input_ids for p in prompts[:3]]
    assert_close(vectors[:3], hf_embeddings(stories_dir, ids, "mean"))


def test_mean_pooling_beside_generation_and_prompt_logprobs(stories_mean, monkeypatch):
    """One step reads a prompt-logprob request's rows and a mean-pooled embedding's rows beside the
    sampled ones, while a plain prompt's other rows are not read (the rows read are not every row);
    a long embedding is then chunked across the steps the generations decode in."""
    engine = stories_mean.engine
    prompt = stories_mean.tokenizer("The dog ran to the park").input_ids
    plain = stories_mean.tokenizer("Once upon a time there was a little").input_ids
    other = stories_mean.tokenizer("Lily saw a bird").input_ids
    long = stories_mean.tokenizer(PROMPTS[2]).input_ids
    ref_other, ref_long = stories_mean.embed([other, long])
    scored = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2)
    (alone,) = stories_mean.generate([prompt], scored)
    (plain_alone,) = stories_mean.generate([plain], SamplingParams(temperature=0.0, max_tokens=6))
    engine.add("scored", prompt, SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2))
    engine.add("plain", plain, SamplingParams(temperature=0.0, max_tokens=6))
    engine.add("emb", other, SamplingParams(max_tokens=1, temperature=0.0), embed=True)
    read = []
    forward = engine.runner.eager.forward

    def spy(flat):
        read.append(flat.every_row_read)
        return forward(flat)

    monkeypatch.setattr(engine.runner.eager, "forward", spy)
    first = {u.rid: u for u in engine.step()}  # all three are prefilled in this one step
    assert set(first) == {"scored", "plain", "emb"} and read == [False]
    assert np.abs(first["emb"].embedding - ref_other).max() < 1e-5
    lp = first["scored"].prompt_logprobs
    assert np.allclose(lp.logprobs[1:], [e["logprob"] for e in alone.prompt_logprobs[1:]], atol=1e-5)
    engine.add("emb-long", long, SamplingParams(max_tokens=1, temperature=0.0), embed=True)
    tokens = {rid: list(first[rid].token_ids) for rid in ("scored", "plain")}
    vector = None
    while engine.has_work():
        for update in engine.step():
            if update.rid in tokens:
                tokens[update.rid] += update.token_ids
            elif update.embedding is not None:
                vector = update.embedding
    assert tokens == {"scored": alone.token_ids, "plain": plain_alone.token_ids}
    assert vector is not None and np.abs(vector - ref_long).max() < 1e-5


def test_mean_pooling_starts_over_after_preemption(stories_dir):
    """A request preempted mid-prompt recomputes every row (its published pages are not taken from the
    prefix cache) into a sum that starts over in its new slot."""
    llm = LLM(stories_dir, max_num_seqs=4, max_model_len=256, device="cpu", max_num_batched_tokens=16,
              pooling="mean")
    engine = llm.engine
    ids = llm.tokenizer(PROMPTS[2]).input_ids
    engine.add("emb", ids, SamplingParams(max_tokens=1, temperature=0.0), embed=True)
    engine.step()
    engine.step()  # two chunks summed
    seq = engine.requests["emb"]
    assert 0 < seq.num_computed < len(ids)
    engine.scheduler.preempt(seq)
    vector = None
    while engine.has_work():
        for update in engine.step():
            vector = update.embedding if update.embedding is not None else vector
    assert seq.num_preemptions == 1 and seq.num_cached_tokens == 0
    assert vector is not None
    assert_close([vector], hf_embeddings(stories_dir, [ids], "mean"))


def test_mean_pooling_without_normalisation_is_the_average(stories_dir):
    llm = LLM(stories_dir, max_num_seqs=4, max_model_len=256, device="cpu", max_num_batched_tokens=16,
              pooling="mean", embed_normalize=False)
    ids = llm.tokenizer(PROMPTS[1]).input_ids
    assert len(ids) > 16
    (vector,) = llm.embed([ids])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32)
    with torch.no_grad():
        raw = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].mean(0).numpy()
    assert np.abs(vector - raw).max() < 1e-4


@pytest.mark.slow  # a process group of two ranks
def test_tensor_parallel_mean_pooling_equals_hugging_face(stories_dir):
    tp = LLM(stories_dir, device="cpu", dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=32,
             max_model_len=256, pooling="mean")
    try:
        ids = [tp.tokenizer(p).input_ids for p in PROMPTS]
        got = tp.embed(ids)
    finally:
        tp.engine.close()
    assert_close(got, hf_embeddings(stories_dir, ids, "mean"))


@pytest.mark.slow
def test_openai_client_mean_pooled_embeddings(stories, stories_dir, tmp_path):
    import openai

    from pipeserve.local_cluster import LocalCluster

    ids = [stories.tokenizer(p).input_ids for p in PROMPTS]
    reference = hf_embeddings(stories_dir, ids, "mean")
    with (LocalCluster(tmp_path / "server.log", stories_dir, "--pooling", "mean", "--max-num-batched-tokens",
                       "32", workers=1, startup=180) as cluster,
          openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="x", max_retries=0, timeout=60) as client):
        many = client.embeddings.create(model="stories260K", input=PROMPTS)
        assert_close([np.asarray(d.embedding, dtype=np.float32) for d in many.data], reference)
        assert many.usage.prompt_tokens == sum(map(len, ids))
        by_ids = client.embeddings.create(model="stories260K", input=ids, encoding_format="float")
        assert_close([np.asarray(d.embedding, dtype=np.float32) for d in by_ids.data], reference)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_prompt_whose_last_chunk_is_one_token_is_pooled(stories_dir, pooling):
    # A 30-token prompt takes 30 of the step's 32 tokens, so the 3-token one runs 2 tokens, then its
    # last alone: that one-token chunk is still a prompt chunk, its row pooled (not a decode row).
    llm = LLM(stories_dir, max_num_seqs=8, max_model_len=256, device="cpu", max_num_batched_tokens=32,
              pooling=pooling)
    rng = np.random.default_rng(1)
    ids = [rng.integers(3, 512, size=n).tolist() for n in (30, 3)]
    assert_close(llm.embed(ids), hf_embeddings(stories_dir, ids, pooling))
