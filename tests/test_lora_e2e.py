"""LoRA through `pipeserve up` (stories260K, --enable-lora): over HTTP (the OpenAI model field selects
the adapter, in completions, chat and /v1/responses; /v1/models lists it with its parent; runtime load
and unload) and gRPC (GenerateRequest.lora, ModelInfoResponse.loras): greedy tokens identical to Hugging
Face PEFT's, unknown adapters 404 / NOT_FOUND, broken adapter directories a 400 naming the file or
saying "rank", the metrics."""

from __future__ import annotations

import json
import os
import shutil

import grpc
import httpx
import pytest

from pipeserve.local_cluster import LocalCluster, scrape
from tests.lora_adapters import ALL_LINEAR, ATTENTION, build_adapter, hf_greedy

pytestmark = pytest.mark.slow  # `pipeserve up` pipelines

N = 8
PROMPTS = [[1, 43, 107, 61, 78, 30], [1, 5, 9, 200, 17, 33, 64, 12]]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def adapters(stories_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list]]:
    """name -> (directory, HF PEFT's greedy tokens on PROMPTS); "broken-*": bad directories."""
    tmp = tmp_path_factory.mktemp("lora-e2e")
    out = {}
    for i, (name, rank, targets) in enumerate([("sql", 8, ATTENTION), ("chat", 16, ALL_LINEAR)]):
        path = str(tmp / name)
        out[name] = (
            path,
            hf_greedy(build_adapter(stories_dir, path, rank, targets, seed=10 + i), PROMPTS, N),
        )
    src = out["sql"][0]
    for name, remove in (
        ("broken-config", "adapter_config.json"),
        ("broken-weights", "adapter_model.safetensors"),
    ):
        shutil.copytree(src, str(tmp / name))
        os.remove(str(tmp / name / remove))
        out[name] = (str(tmp / name), [])
    shutil.copytree(src, str(tmp / "broken-rank"))
    config_path = tmp / "broken-rank" / "adapter_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"r": 64}))
    out["broken-rank"] = (str(tmp / "broken-rank"), [])
    return out


@pytest.fixture(scope="module")
def cluster(stories_dir: str, adapters, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("lora-log") / "up.log"
    flags = [
        "--enable-lora",
        "--lora-modules",
        f"sql={adapters['sql'][0]}",
        "--allow-runtime-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--num-pages",
        "256",
        "--chat-template",  # messages requests (chat, /v1/responses): the user's text as the prompt
        CHAT_TEMPLATE,
    ]
    with LocalCluster(log, stories_dir, *flags, workers=1, startup=180) as srv:
        yield srv


def complete(cluster: LocalCluster, model: str, prompt: list[int]) -> httpx.Response:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": N,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return httpx.post(f"{cluster.http_url}/v1/completions", json=body, timeout=60)


def test_http_and_grpc_match_peft(cluster: LocalCluster, adapters) -> None:
    models = httpx.get(f"{cluster.http_url}/v1/models", timeout=10).json()["data"]
    base = models[0]["id"]
    assert models[0]["parent"] is None
    assert [(m["id"], m["parent"]) for m in models[1:]] == [("sql", base)]
    for j, prompt in enumerate(PROMPTS):
        response = complete(cluster, "sql", prompt)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "sql"
        assert response.json()["choices"][0]["token_ids"] == adapters["sql"][1][j]
        assert (
            cluster.client.generate(
                prompt, lora="sql", max_tokens=N, temperature=0, ignore_eos=True
            ).token_ids
            == adapters["sql"][1][j]
        )
    assert list(cluster.client.model_info().loras) == ["sql"]


def test_unknown_adapter(cluster: LocalCluster) -> None:
    response = complete(cluster, "nope", PROMPTS[0])
    assert response.status_code == 404
    with pytest.raises(grpc.RpcError) as err:
        cluster.client.generate(PROMPTS[0], lora="nope", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()


def _responses_text(body: dict) -> str:
    return "".join(part["text"] for item in body["output"] if item["type"] == "message"
                   for part in item["content"])


def test_responses_api_selects_the_adapter(cluster: LocalCluster) -> None:
    """/v1/responses names an adapter in `model` as chat completions does: the same greedy text as a
    chat completion of the same message with that adapter (the base model's differs); streamed too;
    an unknown name is a 404."""
    url, text = cluster.http_url, "Once upon a time there was a little"
    texts = {}
    for model in ("sql", None):
        body = {"input": text, "max_output_tokens": N, "temperature": 0} | ({"model": model} if model else {})
        response = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == (model or cluster.client.model_info().name)
        chat = {"messages": [{"role": "user", "content": text}], "max_tokens": N, "temperature": 0}
        chat |= {"model": model} if model else {}
        reply = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert reply.status_code == 200, reply.text
        texts[model] = _responses_text(response.json())
        assert texts[model] == reply.json()["choices"][0]["message"]["content"]
    assert texts["sql"] != texts[None]  # the adapter ran
    stream = {"model": "sql", "input": text, "max_output_tokens": N, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/responses", json=stream, timeout=60) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    done = events[-1]["response"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete") and done["model"] == "sql"
    assert _responses_text(done) == texts["sql"]
    missing = httpx.post(f"{url}/v1/responses", json={"model": "nope", "input": text}, timeout=60)
    assert missing.status_code == 404 and "nope" in missing.text


def test_runtime_load_and_unload(cluster: LocalCluster, adapters) -> None:
    url = cluster.http_url
    for name, needle in (
        ("broken-config", "adapter_config.json"),
        ("broken-weights", "adapter_model.safetensors"),
        ("broken-rank", "rank"),
    ):
        response = httpx.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": adapters[name][0]},
            timeout=10,
        )
        assert 400 <= response.status_code < 500 and needle in response.json()["error"]["message"], (
            response.text
        )
    missing = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent/dir"}, timeout=10
    )
    assert missing.status_code == 400
    load = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": "chat", "lora_path": adapters["chat"][0]},
        timeout=10,
    )
    assert load.status_code == 200, load.text
    again = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": "chat", "lora_path": adapters["chat"][0]},
        timeout=10,
    )
    assert again.status_code == 400 and "already loaded" in again.text
    names = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
    assert names[1:] == ["sql", "chat"]
    assert list(cluster.client.model_info().loras) == ["sql", "chat"]
    for j, prompt in enumerate(PROMPTS):
        assert complete(cluster, "chat", prompt).json()["choices"][0]["token_ids"] == adapters["chat"][1][j]
        assert (
            cluster.client.generate(
                prompt, lora="chat", max_tokens=N, temperature=0, ignore_eos=True
            ).token_ids
            == adapters["chat"][1][j]
        )
    assert (
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=10).status_code == 200
    )
    assert complete(cluster, "chat", PROMPTS[0]).status_code == 404
    with pytest.raises(grpc.RpcError) as err:
        cluster.client.generate(PROMPTS[0], lora="chat", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert (
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=10).status_code == 404
    )
    names = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
    assert names[1:] == ["sql"]


def test_metrics_count_swaps(cluster: LocalCluster) -> None:
    assert complete(cluster, "sql", PROMPTS[0]).status_code == 200
    # The engine's counters reach the gateway in heartbeats: wait for one that carries the swap.
    cluster.wait(
        lambda: scrape(cluster.metrics_port).get('pipeserve:lora_swaps_total{engine="0"}', 0) >= 1,
        10,
        "the swaps counter",
    )


def test_bad_lora_module_fails_at_start(stories_dir: str, adapters) -> None:
    import subprocess
    import sys

    from pipeserve.local_cluster import ROOT, free_port

    argv = [sys.executable, "-m", "pipeserve.cli", "up", "--model", stories_dir, "--enable-lora",
            "--lora-modules", f"big={adapters['broken-rank'][0]}", "--port", str(free_port()),
            "--http-port", str(free_port())]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--lora-modules big:" in out.stderr and "rank r=64 is above max_lora_rank=16" in out.stderr
