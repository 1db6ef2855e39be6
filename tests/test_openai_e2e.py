"""The OpenAI-compatible HTTP API of a real `pipeserve up` serving stories260K, driven by clients
nobody here wrote: the official `openai` SDK (sync and async), raw httpx, and lm-evaluation-harness
(`local-completions` against the server equals lm-eval's own `hf` model on the same checkpoint)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from pipeserve.local_cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "Once upon a time, there was a little"


@pytest.fixture(scope="module")
def cluster(stories_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("openai") / "server.log"
    with LocalCluster(log, stories_dir, workers=1, startup=120) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def test_completions_match_grpc_and_stream(cluster, client):
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    grpc = cluster.client.generate(PROMPT, max_tokens=12, temperature=0.0)
    assert out.choices[0].text == grpc.text and out.usage.completion_tokens == 12
    assert out.choices[0].finish_reason == "length"
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == grpc.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    stopped = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[grpc.text[4:8]]
    )
    assert stopped.choices[0].text == grpc.text[:4] and stopped.choices[0].finish_reason == "stop"


def test_n_seeds_and_async(cluster, client):
    async def run() -> list[list[str]]:
        async with openai.AsyncOpenAI(base_url=cluster.http_url + "/v1", api_key="x", max_retries=0) as c:
            calls = [
                c.completions.create(
                    model="stories260K", prompt=PROMPT, max_tokens=40, n=2, seed=5, temperature=1.5
                )
                for _ in range(2)
            ]
            return [[ch.text for ch in r.choices] for r in await asyncio.gather(*calls)]

    first, second = asyncio.run(run())
    assert first == second  # seeded: reproducible
    assert first[0] != first[1]  # each choice its own seed stream (seed + i)
    grpc = [
        cluster.client.generate(PROMPT, max_tokens=40, seed=seed, temperature=1.5).text for seed in (5, 6)
    ]
    assert first == grpc


@pytest.mark.parametrize("stream", [False, True])
def test_chat_without_a_template_is_refused_naming_the_cause(client, stream):
    """The tokenizer refuses it before any token: a 400 streamed or not (the stream never starts)."""
    with pytest.raises(openai.BadRequestError) as info:
        messages = [{"role": "user", "content": "hi"}]
        out = client.chat.completions.create(model="stories260K", messages=messages, stream=stream)
        if stream:
            list(out)
    assert "chat template" in info.value.message and info.value.param == "messages"


def test_max_tokens_beyond_the_context_is_refused_before_the_stream_starts(client):
    with pytest.raises(openai.BadRequestError) as info:
        list(client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=600, stream=True))
    assert info.value.param == "max_tokens" and "context" in info.value.message


def test_echo_prompt_logprobs_equal_hf(stories_dir, client):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(stories_dir)(PROMPT).input_ids
    out = client.completions.create(
        model="stories260K", prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    lp = out.choices[0].logprobs
    assert out.usage.completion_tokens == 0 and len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    hf = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
    expected = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
    np.testing.assert_allclose(lp.token_logprobs[1:], expected, atol=1e-3)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert out.choices[0].text.endswith(PROMPT)


def test_tokenize_detokenize(stories_dir, cluster):
    from transformers import AutoTokenizer

    tokens = httpx.post(cluster.http_url + "/tokenize", json={"prompt": PROMPT}, timeout=60).json()
    assert tokens["tokens"] == AutoTokenizer.from_pretrained(stories_dir)(PROMPT).input_ids
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = httpx.post(cluster.http_url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=60).json()
    assert text["prompt"].endswith(PROMPT)


def test_disconnect_mid_stream_frees_the_request_and_metrics_count(cluster):
    with httpx.Client(base_url=cluster.http_url, timeout=30) as http:
        before = metrics(http)
        body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = response.iter_lines()
            assert next(events).startswith("data: {")
        cluster.wait_idle(30)
        running = 'pipeserve:num_requests_running{engine="0"}'
        cluster.wait(lambda: metrics(http)[running] == 0, 10, "0 running")
        for _ in range(3):
            http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True})
        after = metrics(http)
    done = 'pipeserve:request_success_total{finished_reason="length"}'
    assert after[done] - before[done] == 3
    assert after["pipeserve:generation_tokens_total"] - before["pipeserve:generation_tokens_total"] >= 15
    assert (
        after["pipeserve:e2e_request_latency_seconds_count"]
        - before["pipeserve:e2e_request_latency_seconds_count"]
        == 3
    )


def metrics(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def write_tasks(directory: Path) -> None:
    """A multiple-choice (loglikelihood) and a generate_until task from local JSONL (lm-eval puts a
    space between context and continuation)."""
    stories = [
        ("Tom had a red ball. He liked to", ["play", "sleep", "cry"], 0),
        ("Lily went to the park. She saw a big", ["dog", "car", "house"], 0),
        ("The sun was hot. The children wanted to", ["swim", "read", "eat"], 0),
        ("Once upon a time there was a little", ["girl", "boy", "cat"], 1),
    ]
    (directory / "mc.jsonl").write_text(
        "".join(json.dumps({"context": c, "choices": ch, "label": label}) + "\n" for c, ch, label in stories)
    )
    (directory / "gen.jsonl").write_text(
        "".join(json.dumps({"context": c, "target": ch[label]}) + "\n" for c, ch, label in stories)
    )
    for name, body in (
        (
            "stories_mc",
            "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
            "metric_list:\n  - metric: acc\n",
        ),
        (
            "stories_gen",
            "output_type: generate_until\ndoc_to_target: '{{target}}'\n"
            "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 8\n  do_sample: false\n"
            "metric_list:\n  - metric: exact_match\n",
        ),
    ):
        data = directory / ("mc.jsonl" if name == "stories_mc" else "gen.jsonl")
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\ndoc_to_text: '{{{{context}}}}'\n{body}"
        )


# Every seed lm-eval's simple_evaluate takes, fixed: the served and the local run draw alike.
LM_EVAL_SEEDS = {"random_seed": 0, "numpy_random_seed": 0, "torch_random_seed": 0, "fewshot_random_seed": 0}


def test_lm_eval_local_completions_equals_hf(stories_dir, cluster, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    tasks = TaskManager(include_path=str(tmp_path))
    common = {
        "tasks": ["stories_mc", "stories_gen"],
        "task_manager": tasks,
        "log_samples": True,
        **LM_EVAL_SEEDS,
    }
    served = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=stories260K,base_url={cluster.http_url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={stories_dir},num_concurrent=1,max_retries=1,tokenized_requests=True,add_bos_token=True",
        **common,
    )
    local = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={stories_dir},dtype=float32,add_bos_token=True",
        device="cpu",
        **common,
    )
    assert served["results"]["stories_mc"]["acc,none"] == local["results"]["stories_mc"]["acc,none"]
    assert (
        served["results"]["stories_gen"]["exact_match,none"]
        == local["results"]["stories_gen"]["exact_match,none"]
    )

    def per_sample(run: dict, task: str) -> list:
        return [s["resps"] for s in sorted(run["samples"][task], key=lambda s: s["doc_id"])]

    for ours, theirs in zip(per_sample(served, "stories_mc"), per_sample(local, "stories_mc"), strict=True):
        for (ll, greedy), (ref_ll, ref_greedy) in zip(
            [r[0] for r in ours], [r[0] for r in theirs], strict=True
        ):
            assert math.isclose(ll, ref_ll, abs_tol=1e-3) and greedy == ref_greedy

    # The same generations; `hf` decodes the continuation's ids alone, where SentencePiece drops the
    # leading space that the server's text keeps (it is the text that continues the prompt).
    def texts(run: dict) -> list[str]:
        return [r[0][0].strip() for r in per_sample(run, "stories_gen")]

    assert texts(served) == texts(local) and all(texts(served))
