"""`pipeserve bench serve`: the workload plan, the client machinery against a scripted gRPC server with
known timings and failures, and end to end against `pipeserve up` on stories260K."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pipeserve.bench import serve
from pipeserve.bench.workload import gamma_arrivals, load_trace
from pipeserve.gateway.pb import generation_pb2 as pb
from pipeserve.gateway.pb import generation_pb2_grpc as pb_grpc
from pipeserve.local_cluster import LocalCluster, free_port
from tests.conftest import png_panels

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent
TTFT, GAP = 0.2, 0.05  # the scripted server's first-token delay and gap between chunks, s
FAIL_LEN, SHORT_LEN = 13, 17  # prompts of these lengths are refused / answered one token short


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def write_trace(path: Path, rows: list[tuple[float, int, int]]) -> Path:
    """A trace CSV with requests at these offsets (s) and lengths."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:00:{t:09.6f},{p},{o}" for t, p, o in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- the workload plan ---------------------------------------------------------------------------
def test_plan_replays_the_trace(traces_dir: Path) -> None:
    args = parse(["--rate-scale", "10", "--num-requests", "50", "--duration", "2"])
    planned = serve.plan(args, context=512)
    expected = load_trace(sorted(traces_dir.glob("*.csv")), 512, 10.0, 2.0, 50)
    assert [(r.arrival, r.prompt_tokens, r.output_tokens, r.app) for r in planned] == [
        (r.arrival, r.prompt_tokens, r.output_tokens, r.app) for r in expected
    ]
    assert all(r.prompt_tokens + r.output_tokens <= 512 and r.arrival < 2.0 for r in planned)


def test_plan_with_a_rate(traces_dir: Path) -> None:
    fixed = serve.plan(parse(["--rate", "5", "--input-len", "8", "--output-len", "4", "--num-requests", "20",
                              "--seed", "3"]), context=64)  # fmt: skip
    assert [r.arrival for r in fixed] == gamma_arrivals(20, 5.0, 1.0, seed=3)
    assert {(r.prompt_tokens, r.output_tokens, r.app) for r in fixed} == {(8, 4, "fixed")}
    # Trace lengths in trace order, gamma arrivals, cut at --duration.
    argv = ["--rate", "4", "--burstiness", "0.5", "--num-requests", "30", "--duration", "3"]
    mixed = serve.plan(parse(argv), context=512)
    trace = load_trace(sorted(traces_dir.glob("*.csv")), 512, max_requests=30)
    arrivals = gamma_arrivals(30, 4.0, 0.5, seed=0)
    assert [r.arrival for r in mixed] == [t for t in arrivals if t < 3]
    assert [(r.prompt_tokens, r.output_tokens) for r in mixed] == [
        (r.prompt_tokens, r.output_tokens) for r in trace[: len(mixed)]
    ]
    everything = serve.plan(parse(["--rate", "inf", "--input-len", "2", "--output-len", "2"]), context=8)
    assert len(everything) == 100 and {r.arrival for r in everything} == {0.0}


@pytest.mark.parametrize(
    "argv",
    [["--input-len", "8", "--output-len", "4"], ["--rate", "1", "--input-len", "8"],
     ["--rate", "1", "--input-len", "60", "--output-len", "5"]],
)  # fmt: skip
def test_plan_rejects(argv: list[str]) -> None:
    with pytest.raises(ValueError, match="--input-len"):
        serve.plan(parse(argv), context=64)


def test_unreachable_server_or_unreadable_trace_is_a_clean_exit(scripted, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not SERVING"):
        serve.main(parse(["--target", f"127.0.0.1:{free_port()}", "--ready-timeout", "0.5"]))
    with pytest.raises(SystemExit, match="missing.csv"):
        serve.main(parse(["--target", scripted[0], "--trace", str(tmp_path / "missing.csv")]))


# ---- against a scripted server -------------------------------------------------------------------
class ScriptedGeneration(pb_grpc.GenerationServicer):
    """Streams every request's max_tokens after TTFT, one chunk per GAP, the third chunk carrying
    two tokens; refuses prompts of FAIL_LEN tokens and answers SHORT_LEN ones a token short."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.requests.append(request)
        n = len(request.prompt_token_ids.ids)
        if n == FAIL_LEN:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests in flight")
        total = request.max_tokens - (n == SHORT_LEN)
        await asyncio.sleep(TTFT)
        sent, chunk = 0, 0
        while sent < total:
            k = min(2 if chunk == 2 else 1, total - sent)
            sent, chunk = sent + k, chunk + 1
            last = sent == total
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[7] * k, text="ab"[:k],
                                      finish_reason="length" if last else "")  # fmt: skip
            if not last:
                await asyncio.sleep(GAP)

    async def ModelInfo(self, request, context) -> pb.ModelInfoResponse:
        return pb.ModelInfoResponse(name="scripted", context_length=512, vocab_size=300, dtype="float32",
                                    device="cpu")  # fmt: skip


@pytest.fixture
def scripted() -> Iterator[tuple[str, ScriptedGeneration]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servicer = ScriptedGeneration()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        checker = health.aio.HealthServicer()
        await checker.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield f"127.0.0.1:{port}", servicer
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_serve_against_a_scripted_server(scripted, tmp_path: Path) -> None:
    target, servicer = scripted
    chat = write_trace(tmp_path / "chat.csv", [(1.0, 10, 6), (1.2, FAIL_LEN, 6), (1.4, 11, 6), (1.6, 12, 1)])
    code = write_trace(tmp_path / "code.csv", [(1.1, SHORT_LEN, 6), (1.3, 20, 6)])
    out = tmp_path / "out"
    args = parse(["--target", target, "--trace", str(chat), str(code), "--slo-tpot", "1.0",
                  "--json", str(tmp_path / "s.json"), "--out", str(out)])  # fmt: skip
    assert serve.main(args) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert result["server"]["name"] == "scripted"
    # What the server received: synthetic ids of each prompt's length, greedy, ignore_eos, max_tokens.
    lengths = sorted(len(r.prompt_token_ids.ids) for r in servicer.requests)
    assert lengths == [10, 11, 12, FAIL_LEN, SHORT_LEN, 20]
    for r in servicer.requests:
        assert r.ignore_eos and r.temperature == 0 and r.app in ("chat", "code")
        assert all(0 <= i < 300 for i in r.prompt_token_ids.ids)
    requests = {r["prompt_tokens"]: r for r in result["requests"]}
    assert requests[FAIL_LEN]["error"].startswith("RESOURCE_EXHAUSTED")
    assert requests[SHORT_LEN]["error"] == "got 5 tokens, asked for 6"
    for n, arrival in ((10, 0.0), (11, 0.4), (12, 0.6), (20, 0.3)):
        r = requests[n]
        # Sent on the trace's clock, never early (asyncio may fire a timer up to its clock
        # resolution early: a millisecond's slack); how late depends on the machine's load.
        assert r["error"] is None and r["finish_reason"] == "length" and r["send_s"] >= arrival - 1e-3
        assert r["arrival_s"] == pytest.approx(arrival, abs=1e-4) and r["max_tokens"] == r["output_tokens"]
        assert TTFT <= r["ttft_s"] <= r["e2e_s"]  # the server waits TTFT before its first chunk
    # Sent in the trace's order, the code trace's requests interleaved with the chat trace's.
    sent = sorted(result["requests"], key=lambda r: r["send_s"])
    assert [r["arrival_s"] for r in sent] == sorted(r["arrival_s"] for r in sent)
    # 6 tokens in 5 chunks: 4 gaps of at least GAP, so TPOT >= 4 GAP / 5, by its definition.
    for n in (10, 11, 20):
        r = requests[n]
        assert r["output_tokens"] == 6 and r["chunks"] == 5
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 5) and r["tpot_s"] >= 0.8 * GAP
    assert requests[12]["tpot_s"] is None  # one token: TPOT undefined
    s = result["summary"]
    assert (s["requests"], s["completed"], s["failed"]) == (6, 4, 2)
    assert s["output_tokens"] == 19 and s["input_tokens"] == 10 + 11 + 12 + 20
    assert s["itl_s"]["count"] == 12 and s["itl_s"]["p50"] >= GAP
    assert s["goodput"] == pytest.approx(4 / s["duration_s"])  # every completed one meets a 1 s TPOT SLO
    # First send to the last chunk: the request sent last, then its TTFT and 4 gaps, at least.
    assert s["duration_s"] >= max(r["send_s"] + r["e2e_s"] for r in sent if r["e2e_s"] is not None) - 1e-9
    assert s["duration_s"] >= 0.4 + TTFT + 4 * GAP
    assert set(result["apps"]) == {"chat", "code"} and result["apps"]["code"]["failed"] == 1
    assert png_panels(out / "serve.png") == 3  # TTFT, TPOT, e2e CDFs


# ---- end to end: `pipeserve up` on stories260K ----------------------------------------------------
@pytest.fixture(scope="module")
def server(stories_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_path = tmp_path_factory.mktemp("serve") / "up.log"
    with LocalCluster(log_path, stories_dir, "--kv-cache-gb", "0.05", workers=1, startup=90) as cluster:
        yield cluster


@pytest.mark.slow
@pytest.mark.parametrize("api", ["grpc", "openai"])
def test_serve_end_to_end(server: LocalCluster, api: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = parse(["--target", server.target, "--api", api, "--http-url", server.http_url,
                  "--num-requests", "8", "--rate-scale", "2", "--timeout", "60",
                  "--json", str(tmp_path / "s.json"), "--out", str(out)])  # fmt: skip
    assert serve.main(args) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert result["server"]["name"] == "stories260K" and result["server"]["context_length"] == 512
    assert result["server"]["api"] == api
    s = result["summary"]
    assert (s["requests"], s["completed"], s["failed"]) == (8, 8, 0)
    for r in result["requests"]:
        assert r["error"] is None and r["finish_reason"] == "length"
        assert r["output_tokens"] == r["max_tokens"] and r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
    assert s["output_tokens"] == sum(r["output_tokens"] for r in result["requests"]) > 0
    assert s["request_throughput"] > 0 and s["ttft_s"]["p99"] >= s["ttft_s"]["p50"] > 0
    assert png_panels(out / "serve.png") == 3  # TTFT, TPOT, e2e CDFs
