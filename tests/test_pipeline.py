"""End to end: `pipeserve up` on stories260K (real processes, ipc sockets), real gRPC clients.

One server for the module; the tests that kill processes run last, the shutdown test at the end."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pipeserve.config import Addresses
from pipeserve.gateway.client import AsyncClient, Completion
from pipeserve.gateway.pb import generation_pb2 as pb
from pipeserve.local_cluster import ROOT, LocalCluster
from pipeserve.sampling_params import MAX_STOP_STRINGS, SamplingParams
from tests.conftest import STORIES
from tests.deadlines import mid_generation_deadline

MODEL = STORIES

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason=f"stories260K not found at {MODEL}"),
]

BASES = [
    "Once upon a time",
    "Lily and Ben went to the park",
    "The little dog",
    "One day, a cat",
    "Tom had a red ball",
    "The sun was hot",
    "Mom said",
    "There was a big tree",
]
SUFFIXES = ["", " and", ", 🐉", " 猫", ".", " with a 🌈", " happy", "!"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three tokenizer workers (the kill tests need survivors); --grace 20 for the shutdown test."""
    log_path = tmp_path_factory.mktemp("pipeserve") / "up.log"
    with LocalCluster(log_path, str(MODEL), "--grace", "20", workers=3, startup=90) as srv:
        yield srv


@pytest.fixture(scope="module")
def llm():
    from pipeserve.engine import LLM

    return LLM(str(MODEL), device="cpu")


def run(coro):
    return asyncio.run(coro)


async def stream_all(target: str, requests: list[dict]) -> list[Completion | grpc.RpcError]:
    """Concurrent streams; each result is its Completion, its deltas in .deltas, or its RpcError."""
    async with AsyncClient(target) as client:

        async def one(kwargs: dict) -> Completion | grpc.RpcError:
            completion, deltas = Completion(), []
            try:
                async for chunk in client.stream(**kwargs):
                    completion.add(chunk)
                    deltas.append(chunk.text)
            except grpc.RpcError as exc:
                return exc
            completion.deltas = deltas  # type: ignore[attr-defined]
            return completion

        return await asyncio.gather(*(one(kwargs) for kwargs in requests))


def test_health_serving_only_after_startup(server):
    seen = server.health_seen
    assert seen[-1] == "SERVING" and "NOT_SERVING" in seen[:-1]  # the gateway was up before the engine
    assert (
        sorted(server.children_at_serving.values())
        == ["detokenizer", "engine", "gateway"] + ["tokenizer"] * 3
    )
    assert server.metrics()['pipeserve_engine{name="pages_total"}'] > 0  # the model was loaded


def test_model_info_and_reflection(server):
    info = server.client.model_info()
    assert (info.name, info.context_length, info.vocab_size, list(info.eos_token_ids)) == (
        "stories260K",
        512,
        512,
        [2],
    )
    assert (info.dtype, info.device, info.max_logprobs) == ("float32", "cpu", 20)
    services = ProtoReflectionDescriptorDatabase(server.client.channel).get_services()
    assert "pipeserve.v1.Generation" in services and "grpc.health.v1.Health" in services


def test_64_concurrent_streams_equal_in_process_generate(server, llm):
    from pipeserve.engine import SamplingParams

    prompts = [BASES[i % 8] + SUFFIXES[i // 8] for i in range(64)]
    max_tokens = [4 + (i * 5) % 24 for i in range(64)]
    expected = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens])
    results = run(
        stream_all(
            server.target,
            [
                {"prompt": p, "max_tokens": m, "temperature": 0, "request_id": f"par-{i}"}
                for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
            ],
        )
    )
    for i, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert isinstance(got, Completion), f"stream {i}: {got}"
        assert (got.token_ids, got.text, got.finish_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
        ), i
        assert got.prompt_tokens == len(want.prompt_token_ids) and got.completion_tokens == len(
            want.token_ids
        )
    assert sum(len(r.deltas) for r in results) > 64  # streamed, not one message per request
    server.wait_idle()


def test_cancel_mid_stream_frees_the_engine(server):
    before = server.settled_engine("steps", changed_from=-1)  # heartbeats lag: read counters settled
    call = server.client.stream("Once upon a time", max_tokens=400, ignore_eos=True, request_id="cancel-me")
    chunks = [next(call) for _ in range(3)]
    assert all(c.request_id == "cancel-me" for c in chunks)
    call.cancel()
    ran = server.settled_engine("steps", changed_from=before) - before
    server.wait_idle()
    # The engine stopped on the abort, far short of the 400 steps the request asked for (a step a
    # token), and runs nothing more for it.
    assert ran < 200, ran
    time.sleep(1.0)
    assert server.engine("steps") == before + ran
    assert server.metrics()['pipeserve_gateway_requests_total{outcome="CANCELLED"}'] >= 1


def test_abort_rpc_and_deadline(server):
    call = server.client.stream("Once upon a time", max_tokens=400, ignore_eos=True, request_id="abort-me")
    next(call)
    assert server.client.abort("abort-me") is True
    rest = list(call)
    assert rest[-1].finish_reason == "abort"
    server.wait_idle()
    timeout = mid_generation_deadline(server.client, "Once upon a time", 400)
    server.wait_idle()
    with pytest.raises(grpc.RpcError) as info:
        server.client.generate("Once upon a time", max_tokens=400, ignore_eos=True, timeout=timeout)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_idle()


def test_stop_strings_across_token_boundaries(server, llm):
    prompt, stops = "Once upon a time", ["tle gi", "rl named Li", "park."]
    full = server.client.generate(prompt, max_tokens=30, temperature=0).text
    ids = llm.tokenizer.encode(prompt + full, add_special_tokens=False)
    assert not any(stop in llm.tokenizer.decode([t]) for t in ids for stop in stops)  # each spans tokens
    results = run(
        stream_all(
            server.target,
            [{"prompt": prompt, "max_tokens": 30, "temperature": 0, "stop": [stop]} for stop in stops],
        )
    )
    for stop, got in zip(stops, results, strict=True):
        head = full[: full.index(stop)]
        # Deltas are never retracted, so equal concatenation means no delta ever leaked the stop.
        assert (got.text, "".join(got.deltas), got.finish_reason) == (head, head, "stop")
    server.wait_idle()


def test_utf8_emoji_and_cjk_never_stream_replacement_chars(server, llm):
    prompt = "Lily saw a 🐉 and a 猫 in the 公园."
    requests = [{"prompt": prompt, "max_tokens": 24, "temperature": 3.0, "seed": s} for s in range(32)]
    results = run(stream_all(server.target, requests))
    tok = llm.tokenizer
    prompt_ids = tok.encode(prompt)
    clean_non_ascii = 0
    for got in results:
        assert isinstance(got, Completion), got
        full = tok.decode(prompt_ids + got.token_ids, skip_special_tokens=True)
        head = tok.decode(prompt_ids, skip_special_tokens=True)
        assert full.startswith(head)
        expected = full[len(head) :]
        assert "".join(got.deltas) == expected  # nothing retracted, duplicated or lost
        if "\ufffd" not in expected:
            assert not any("\ufffd" in d for d in got.deltas)
            clean_non_ascii += any(ord(c) > 127 for c in expected)
    assert clean_non_ascii >= 1, "no sample produced multi-byte text: the test proved nothing"
    server.wait_idle()


@pytest.mark.parametrize(
    "kwargs, code, field",
    [
        ({"prompt": ""}, "INVALID_ARGUMENT", "prompt"),
        ({"prompt": "Once upon a time " * 200}, "INVALID_ARGUMENT", "prompt"),  # ~1000 tokens > context 512
        ({"prompt": [1, 600]}, "INVALID_ARGUMENT", "prompt_token_ids"),
        ({"prompt": [{"role": "user", "content": "hi"}]}, "INVALID_ARGUMENT", "messages"),  # no chat template
        ({"prompt": "x", "temperature": -0.5}, "INVALID_ARGUMENT", "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "INVALID_ARGUMENT", "top_p"),
        ({"prompt": "x", "logprobs": 21}, "INVALID_ARGUMENT", "logprobs"),
        ({"prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "INVALID_ARGUMENT", "stop"),
        ({"prompt": "x" * (5 * 1024 * 1024)}, "INVALID_ARGUMENT", "prompt"),
    ],
)
def test_bad_inputs_get_status_codes_and_the_server_keeps_serving(server, kwargs, code, field):
    prompt = kwargs.pop("prompt")
    with pytest.raises(grpc.RpcError) as info:
        server.client.generate(prompt, timeout=30, **kwargs)
    assert info.value.code().name == code and field in info.value.details()
    assert server.client.generate("Once upon a time", max_tokens=3, temperature=0).completion_tokens == 3


def test_missing_prompt_is_invalid(server):
    with pytest.raises(grpc.RpcError) as info:
        list(server.client.stub.Generate(pb.GenerateRequest(max_tokens=3), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in info.value.details()


def test_logprobs_stream_with_token_text(server):
    got = server.client.generate("Once upon a time", max_tokens=5, temperature=0, logprobs=3)
    assert len(got.logprobs) == 5
    for lp, token_id in zip(got.logprobs, got.token_ids, strict=True):
        assert lp.token_id == token_id and len(lp.top) == 3 and lp.top[0].token_id == token_id  # greedy
        assert lp.logprob <= 0 and lp.top[0].token
    assert "".join(lp.token for lp in got.logprobs) == got.text


def test_prefix_cache_reports_cached_prompt_tokens_per_salt_and_in_metrics(server):
    prompt = list(range(100, 160))  # 60 ids: 3 full pages of 16 before the last token
    hits = server.engine("prefix_cache_hits")
    first = server.client.generate(prompt, max_tokens=2, temperature=0, cache_salt="tenant-a")
    again = server.client.generate(prompt, max_tokens=2, temperature=0, cache_salt="tenant-a")
    other = server.client.generate(prompt, max_tokens=2, temperature=0, cache_salt="tenant-b")
    assert (first.prompt_tokens, again.prompt_tokens) == (60, 60)
    assert (first.cached_prompt_tokens, again.cached_prompt_tokens, other.cached_prompt_tokens) == (0, 48, 0)
    assert again.token_ids == first.token_ids and other.token_ids == first.token_ids
    server.wait(lambda: server.engine("prefix_cache_hits") >= hits + 48, what="prefix-cache hits in metrics")
    assert server.engine("prefix_cache_queries") >= 3 * 60


def test_pipeserve_generate_cli(server):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pipeserve.cli", "generate", *args, "--target", server.target],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    ok = cli("Once upon a time", "--max-tokens", "8", "--temperature", "0", "--stop", "Lily")
    assert ok.returncode == 0 and ok.stdout.startswith(", there was a little girl"), ok.stderr
    assert "finish=length" in ok.stderr and "completion_tokens=8" in ok.stderr
    bad = cli("Once upon a time", "--top-k", "0")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "top_k" in bad.stderr


def test_generate_cli_logprobs_and_json(server, llm):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pipeserve.cli", "generate", *args, "--target", server.target],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )

    greedy = ("Once upon a time", "--max-tokens", "6", "--temperature", "0")
    shown = cli(*greedy, "--logprobs", "3")
    assert shown.returncode == 0, shown.stderr
    text, header, *rows = shown.stdout.splitlines()
    assert "logprob" in header and "top 3" in header
    assert len(rows) == 6 and all(len(row.split("  ")) >= 3 for row in rows), shown.stdout
    out = cli(*greedy, "--logprobs", "2", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    expected = llm.generate(["Once upon a time"], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert result["text"] == expected.text == text
    assert result["token_ids"] == expected.token_ids and result["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 6 and result["ttft_ms"] > 0
    assert [lp["token_id"] for lp in result["logprobs"]] == expected.token_ids
    assert all(len(lp["top"]) == 2 and lp["top"][0]["logprob"] >= lp["top"][1]["logprob"]
               for lp in result["logprobs"])
    bad = cli("Once upon a time", "--max-tokens", "5000", "--json")
    assert bad.returncode == 1
    error = json.loads(bad.stdout)["error"]
    assert error["code"] == "INVALID_ARGUMENT" and "max_tokens is 5000" in error["message"], error
    assert "at most 507 can be generated" in error["message"]  # 512 context, 5 prompt tokens


def test_processes_are_named(server):
    names = sorted(Path(f"/proc/{pid}/cmdline").read_text().split("\0")[0]
                   for pid in [server.proc.pid, *server.children()])
    assert names == ["pipeserve: detokenizer", "pipeserve: engine 0", "pipeserve: gateway",
                     "pipeserve: tokenizer 0", "pipeserve: tokenizer 1", "pipeserve: tokenizer 2",
                     "pipeserve: up"], names


def test_a_second_server_on_the_port_exits_and_the_first_serves_every_call(server, llm, tmp_path):
    port = str(server.port)
    second = subprocess.run([sys.executable, "-m", "pipeserve.cli", "up", "--port", port],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert f"port {port} on 127.0.0.1 is in use" in second.stderr
    # The gateway alone (no start-up checks): it cannot bind the port either (no SO_REUSEPORT).
    env = os.environ | Addresses.under(str(tmp_path)).to_env()
    gateway = subprocess.run([sys.executable, "-m", "pipeserve.cli", "gateway", "--port", port],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert gateway.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in gateway.stderr, gateway.stderr
    expected = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, temperature=0.0))[0].text
    texts = [server.client.generate("Once upon a time", max_tokens=12, temperature=0.0).text
             for _ in range(8)]
    assert texts == [expected] * 8
    # Readiness is checked for the gateway's own instance id: nobody else answers SERVING for it.
    instance = re.search(r"instance (pipeserve-[0-9a-f]+)", server.tail(400)).group(1)
    assert server.client.health(instance) == "SERVING"
    assert server.client.health("pipeserve-" + "0" * 32) == "UNREACHABLE"  # NOT_FOUND


# ---- faults: these change the processes, so they run last -----------------------------------
def test_every_tokenizer_worker_gets_work(server):
    workers = server.pids("tokenizer")
    assert len(workers) == 3
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)

    async def scenario() -> list[int]:
        async with AsyncClient(server.target) as client:
            tasks = [
                asyncio.create_task(client.generate("Once upon a time", max_tokens=4, temperature=0))
                for _ in range(9)
            ]
            await asyncio.sleep(1.0)
            assert not any(t.done() for t in tasks)  # every worker is stopped: nothing can start
            done = [0]
            for pid in workers:  # resume one at a time: only its share of the requests can finish
                os.kill(pid, signal.SIGCONT)
                deadline = time.monotonic() + 30
                while sum(t.done() for t in tasks) == done[-1] and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                last, still = sum(t.done() for t in tasks), 0.0
                while still < 1.0:  # then until its share is through
                    await asyncio.sleep(0.1)
                    now = sum(t.done() for t in tasks)
                    still, last = (0.0 if now != last else still + 0.1), now
                done.append(last)
            await asyncio.gather(*tasks)
            return done

    try:
        done = run(scenario())
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    assert done[-1] == 9 and all(b > a for a, b in zip(done, done[1:], strict=False)), done


def test_sigkill_a_tokenizer_under_load_loses_nothing_for_good(server):
    victim = server.pids("tokenizer")[0]
    os.kill(victim, signal.SIGSTOP)  # its queue fills deterministically, then it dies with it

    async def scenario() -> tuple[list, list]:
        long = asyncio.create_task(
            stream_all(
                server.target,
                [{"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0} for _ in range(3)],
            )
        )
        await asyncio.sleep(1.5)  # these are running in the engine (the victim's share waits)
        short = asyncio.create_task(
            stream_all(
                server.target,
                [{"prompt": BASES[i % 8], "max_tokens": 6, "temperature": 0} for i in range(12)],
            )
        )
        await asyncio.sleep(2.0)
        os.kill(victim, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(long, short), timeout=60)

    start = time.monotonic()
    long, short = run(scenario())
    everything = long + short
    failed = [r for r in everything if isinstance(r, grpc.RpcError)]
    assert all(r.code() == grpc.StatusCode.UNAVAILABLE for r in failed), failed
    assert failed, "the killed worker's requests should have ended UNAVAILABLE"
    assert all(r.finish_reason in ("length", "stop") for r in everything if isinstance(r, Completion))
    assert time.monotonic() - start < 45
    server.wait(
        lambda: len(server.pids("tokenizer")) == 3 and victim not in server.pids("tokenizer"),
        what="tokenizer restarted",
    )
    results = run(stream_all(server.target, [{"prompt": "Tom had", "max_tokens": 4} for _ in range(6)]))
    assert all(isinstance(r, Completion) and r.completion_tokens == 4 for r in results)
    server.wait_idle()


@pytest.mark.parametrize("name", ["detokenizer", "engine"])
def test_pipeline_process_death_ends_streams_unavailable_and_recovers(server, name):
    (pid,) = server.pids(name)
    calls = [server.client.stream("Once upon a time", max_tokens=400, ignore_eos=True) for _ in range(3)]
    for call in calls:
        next(call)
    os.kill(pid, signal.SIGKILL)
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        details = info.value.details()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"the {name}" in details and "died" in details
    assert server.client.health() == "NOT_SERVING"
    with pytest.raises(grpc.RpcError) as info:
        server.client.generate("Once upon a time", max_tokens=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    server.wait(lambda: server.client.health() == "SERVING", timeout=90, what=f"{name} back")
    assert server.pids(name) not in ([], [pid])
    assert server.client.generate("Once upon a time", max_tokens=5, temperature=0).completion_tokens == 5
    server.wait_idle()


def test_sigterm_lets_in_flight_streams_finish(server):
    children = list(server.children())
    call = server.client.stream("Once upon a time", max_tokens=40, temperature=0, ignore_eos=True)
    first = next(call)
    server.proc.send_signal(signal.SIGTERM)
    rest = list(call)
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 40
    assert server.proc.wait(60) == 0
    for pid in children:
        assert (
            not Path(f"/proc/{pid}").exists()
            or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
        )
