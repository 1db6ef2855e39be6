"""`pipeserve bench reliability`: fault, overload, abort-storm and bad-input figures of a real pipeline.

Starts `pipeserve up` (stories260K or any --model; the demo model when none), then runs each scenario
against it over gRPC and prints what the issue asks to see: cases tried and passed, streams aborted
and state left, overload refusals and their latency, faults injected and streams hung, RSS growth
per process. tests/reliability/ runs the same scenarios with smaller sizes and asserts on them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from services.gateway.client import AsyncClient, Client, build_request
from services.gateway.pb import generation_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
GENERATE = "/pipeserve.v1.Generation/Generate"
PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog", "Tom had a red ball"]
STATE = ("running", "waiting", "pages_used", "requests", "tombstones", "detok_requests")
PIPELINE_PROCESSES = ("gateway", "tokenizer", "engine", "detokenizer")


# ---- a pipeline under test ------------------------------------------------------------------
class Pipeline:
    """`pipeserve up` in a subprocess, with probes into its processes and its metrics."""

    def __init__(self, log_path: Path, model: str | None, *flags: str, workers: int = 2,
                 startup: float = 120.0) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        argv = [*(["--model", model] if model else []), "--device", "cpu", "--port", str(self.port),
                "--metrics-port", str(self.metrics_port), "--tokenizer-workers", str(workers), *flags]
        self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", *argv], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.client = Client(self.target)
        self.wait(lambda: self.client.health(timeout=1) == "SERVING", startup, "SERVING")

    def tail(self, lines: int = 40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def wait(self, predicate: Any, timeout: float = 30.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise RuntimeError(f"pipeserve up exited while waiting for {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not reached in {timeout} s:\n{self.tail()}")
            time.sleep(0.05)

    def children(self) -> dict[int, str]:
        """pid -> subcommand ("engine", "tokenizer", ...) of the launcher's live children."""
        pid, out = self.proc.pid, {}
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            try:
                argv = Path(f"/proc/{child}/cmdline").read_text().split("\0")
                if Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] != "Z":
                    out[int(child)] = argv[3]  # python -c CHILD <subcommand> ...
            except (FileNotFoundError, IndexError):
                continue
        return out

    def pids(self, name: str) -> list[int]:
        return sorted(pid for pid, sub in self.children().items() if sub == name)

    def rss_mb(self) -> dict[str, float]:
        """Resident memory of each process kind (tokenizers summed), in MiB."""
        out: dict[str, float] = {}
        for pid, name in self.children().items():
            try:
                pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
            except (FileNotFoundError, IndexError):
                continue
            out[name] = out.get(name, 0.0) + pages * 4096 / 2**20
        return out

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.decode().splitlines() if line and not line.startswith("#")}

    def state(self) -> dict[str, float]:
        """Every per-request count the pipeline holds: gateway streams and aborted ids awaiting the
        engine, engine requests/pages/tombstones, detokenizer states (as last reported)."""
        m = self.metrics()
        return {"gateway_inflight": m["pipeserve_gateway_inflight"],
                "gateway_aborting": m["pipeserve_gateway_aborting"],
                **{name: m.get(f'pipeserve_engine{{name="{name}"}}', math.nan) for name in STATE}}

    def wait_clean(self, timeout: float = 30.0) -> dict[str, float]:
        """Until no request state is left anywhere (the last state seen, all zeros)."""
        last: dict[str, float] = {}

        def clean() -> bool:
            last.update(self.state())
            return not any(last.values())

        try:
            self.wait(clean, timeout, "no request state left")
        except TimeoutError as exc:
            raise TimeoutError(f"request state left: {last}") from exc
        return last

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.client.close()
        self.log.close()
        return self.proc.returncode


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- bad input ------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    request: bytes  # a serialized GenerateRequest (or bytes that are not one)
    code: str  # the expected grpc status name; "OK" when the request is served (clamped)
    field: str  # the expected error message names this


@dataclass
class CaseResult:
    name: str
    expected: str
    code: str
    details: str
    passed: bool
    ms: float


def _req(prompt: Any = "Once upon a time", **kwargs: Any) -> bytes:
    return build_request(prompt, **kwargs).SerializeToString()


def bad_input_cases(context_len: int, vocab_size: int) -> list[Case]:
    ok = {"max_tokens": 2, "temperature": 0.0}
    invalid_utf8 = _req("AAAAprompt").replace(b"AAAA", b"\xff\xfe\xc3(")
    return [
        Case("empty prompt", _req(""), "INVALID_ARGUMENT", "prompt"),
        Case("whitespace-only prompt", _req(" \t\n "), "INVALID_ARGUMENT", "prompt"),
        Case("prompt beyond the context", _req("Once upon a time " * context_len), "INVALID_ARGUMENT",
             "prompt"),
        Case("no input at all", pb.GenerateRequest(max_tokens=2).SerializeToString(), "INVALID_ARGUMENT",
             "prompt"),
        Case("prompt_token_ids empty", _req([]), "INVALID_ARGUMENT", "prompt_token_ids"),
        Case("prompt_token_ids out of vocab", _req([1, vocab_size]), "INVALID_ARGUMENT", "prompt_token_ids"),
        Case("prompt_token_ids 2**32-1", _req([1, 2**32 - 1]), "INVALID_ARGUMENT", "prompt_token_ids"),
        Case("prompt_token_ids beyond the context", _req([1] * (context_len + 1)), "INVALID_ARGUMENT",
             "prompt_token_ids"),
        Case("max_tokens 0", _req(max_tokens=0), "INVALID_ARGUMENT", "max_tokens"),
        # Clamped to what the context leaves (3 tokens here), by design: not an error.
        Case("max_tokens beyond the context (clamped)",
             _req([1] * (context_len - 3), max_tokens=2**32 - 1, temperature=0.0), "OK", ""),
        Case("temperature negative", _req(temperature=-0.5), "INVALID_ARGUMENT", "temperature"),
        Case("temperature NaN", _req(temperature=math.nan), "INVALID_ARGUMENT", "temperature"),
        Case("temperature inf", _req(temperature=math.inf), "INVALID_ARGUMENT", "temperature"),
        Case("top_p 0", _req(top_p=0.0), "INVALID_ARGUMENT", "top_p"),
        Case("top_p above 1", _req(top_p=1.01), "INVALID_ARGUMENT", "top_p"),
        Case("top_k 0", _req(top_k=0), "INVALID_ARGUMENT", "top_k"),
        Case("top_k below -1", _req(top_k=-2), "INVALID_ARGUMENT", "top_k"),
        Case("min_p negative", _req(min_p=-0.1), "INVALID_ARGUMENT", "min_p"),
        Case("min_p above 1", _req(min_p=1.5), "INVALID_ARGUMENT", "min_p"),
        Case("repetition_penalty 0", _req(repetition_penalty=0.0), "INVALID_ARGUMENT", "repetition_penalty"),
        Case("presence_penalty above 2", _req(presence_penalty=2.5), "INVALID_ARGUMENT", "presence_penalty"),
        Case("frequency_penalty below -2", _req(frequency_penalty=-3.0), "INVALID_ARGUMENT",
             "frequency_penalty"),
        # seed is uint64 on the wire: a client's int64 -1 arrives as 2**64-1.
        Case("seed negative (int64 -1)", _req(seed=2**64 - 1), "INVALID_ARGUMENT", "seed"),
        Case("min_tokens above max_tokens", _req(max_tokens=2, min_tokens=3), "INVALID_ARGUMENT",
             "min_tokens"),
        Case("1,000 stop strings", _req(stop=["s"] * 1000), "INVALID_ARGUMENT", "stop"),
        Case("a 1 MB stop string", _req(stop=["x" * 2**20]), "INVALID_ARGUMENT", "stop"),
        Case("an empty stop string", _req(stop=[""]), "INVALID_ARGUMENT", "stop"),
        Case("65 stop_token_ids", _req(stop_token_ids=list(range(65))), "INVALID_ARGUMENT", "stop_token_ids"),
        Case("logprobs above the limit", _req(logprobs=10_000), "INVALID_ARGUMENT", "logprobs"),
        Case("invalid UTF-8 in prompt bytes", invalid_utf8, "INVALID_ARGUMENT", "prompt"),
        Case("unknown chat role", _req([{"role": "wizard", "content": "hi"}]), "INVALID_ARGUMENT", "role"),
        Case("empty chat role", _req([{"role": "", "content": "hi"}]), "INVALID_ARGUMENT", "role"),
        Case("empty messages list", pb.GenerateRequest(messages=pb.ChatMessages()).SerializeToString(),
             "INVALID_ARGUMENT", "messages"),
        Case("1,025 messages", _req([{"role": "user", "content": "hi"}] * 1025), "INVALID_ARGUMENT",
             "messages"),
        Case("request_id of 257 characters", _req(request_id="r" * 257), "INVALID_ARGUMENT", "request_id"),
        Case("a 5 MB prompt (over --max-request-bytes)", _req("x" * (5 * 2**20)), "INVALID_ARGUMENT",
             "prompt"),
        # Over gRPC's own receive limit: refused before it is parsed, so no field can be named.
        Case("a 100 MB request", _req("x" * (100 * 2**20)), "RESOURCE_EXHAUSTED", "larger than max"),
        Case("not a protobuf at all", b"\xff" * 64, "INVALID_ARGUMENT", "GenerateRequest"),
        Case("a valid request (control)", _req(**ok), "OK", ""),
    ]


async def _call(channel: grpc.aio.Channel, request: bytes, timeout: float = 60.0) -> tuple[str, str]:
    call = channel.unary_stream(GENERATE, response_deserializer=pb.GenerateResponse.FromString)
    try:
        async for _ in call(request, timeout=timeout):
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or ""
    return "OK", ""


async def run_bad_inputs(target: str) -> list[CaseResult]:
    """Every bad-input case, plus a duplicate in-flight id and Abort of an unknown id."""
    async with AsyncClient(target) as client:
        info = await client.model_info()
        channel = grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 2**30)])
        results = []
        for case in bad_input_cases(info.context_length, info.vocab_size):
            start = time.perf_counter()
            code, details = await _call(channel, case.request)
            results.append(CaseResult(case.name, case.code, code, details[:200],
                                      code == case.code and case.field in details,
                                      (time.perf_counter() - start) * 1e3))
        # A duplicate of an id in flight: ALREADY_EXISTS naming request_id; the first stream is unharmed.
        first = client.stream(PROMPTS[0], request_id="dup-id", max_tokens=64, ignore_eos=True)
        await first.read()
        start = time.perf_counter()
        code, details = await _call(channel, _req(request_id="dup-id", max_tokens=2))
        results.append(CaseResult("duplicate request_id in flight", "ALREADY_EXISTS", code, details,
                                  code == "ALREADY_EXISTS" and "request_id" in details,
                                  (time.perf_counter() - start) * 1e3))
        first.cancel()
        start = time.perf_counter()
        found = await client.abort("no-such-request")
        results.append(CaseResult("Abort of an unknown id", "OK found=False", f"OK found={found}", "",
                                  not found, (time.perf_counter() - start) * 1e3))
        await channel.close()
        return results


# ---- abort storm ----------------------------------------------------------------------------
PHASES = ("before_admission", "prefill", "decode", "after_last")


@dataclass
class StormResult:
    streams: int
    phases: dict[str, int]
    outcomes: dict[str, int]  # "completed", "CANCELLED", other status names
    seconds: float
    state_left: dict[str, float] = field(default_factory=dict)


async def abort_storm(target: str, streams: int, concurrency: int = 64, seed: int = 0) -> StormResult:
    """`streams` streams, each cancelled at a random point: before the gateway admits it, while the
    prompt is prefilled (a few ms in), mid-decode (after 1..n chunks) or after its last token."""
    rng = random.Random(seed)
    plan = [(rng.choice(PHASES), rng.randint(2, 24), rng.random()) for _ in range(streams)]
    phases = {p: sum(1 for q, _, _ in plan if q == p) for p in PHASES}
    outcomes: dict[str, int] = {}
    gate = asyncio.Semaphore(concurrency)
    async with AsyncClient(target) as client:

        async def one(i: int, phase: str, max_tokens: int, u: float) -> None:
            async with gate:
                call = client.stream(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, ignore_eos=True,
                                     temperature=1.0, request_id=f"storm-{seed}-{i}", timeout=120)
                try:
                    if phase == "prefill":
                        await asyncio.sleep(u * 0.005)
                    elif phase == "decode":
                        for _ in range(1 + int(u * (max_tokens - 1))):
                            if (await call.read()) is grpc.aio.EOF:
                                break
                    elif phase == "after_last":
                        while (await call.read()) is not grpc.aio.EOF:
                            pass
                    call.cancel()
                    code = await call.code()
                    outcome = "completed" if code is grpc.StatusCode.OK else code.name
                except grpc.aio.AioRpcError as exc:
                    outcome = exc.code().name
                except asyncio.CancelledError:
                    outcome = "CANCELLED"
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

        start = time.monotonic()
        await asyncio.gather(*(one(i, *p) for i, p in enumerate(plan)))
    return StormResult(streams, phases, outcomes, time.monotonic() - start)


# ---- report ---------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    parser.add_argument("--streams", type=int, default=1000, help="abort-storm streams")
    parser.add_argument("--json", default=None, help="also write the figures here")


def main(args: argparse.Namespace) -> int:
    import tempfile

    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pipeserve-reliability-") as tmp:
        pipe = Pipeline(Path(tmp) / "up.log", args.model)
        try:
            results = asyncio.run(run_bad_inputs(pipe.target))
            figures["bad_input"] = {"tried": len(results), "passed": sum(r.passed for r in results),
                                    "failed": [asdict(r) for r in results if not r.passed],
                                    "state_left": pipe.wait_clean()}
            storm = asyncio.run(abort_storm(pipe.target, args.streams))
            storm.state_left = pipe.wait_clean()
            figures["abort_storm"] = asdict(storm)
        finally:
            pipe.stop()
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


# ---- overload -------------------------------------------------------------------------------
@dataclass
class OverloadResult:
    offered: int
    admitted: int
    refused: int
    refusal_ms_p50: float
    refusal_ms_max: float
    tpot_ms_unloaded: float
    tpot_ms_loaded: float
    other: dict[str, int]


async def _tpot(client: AsyncClient, i: int, max_tokens: int) -> tuple[str, float]:
    """One greedy ignore_eos stream: its outcome and time per output token after the first (ms)."""
    start, first, n = time.perf_counter(), None, 0
    try:
        async for chunk in client.stream(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, ignore_eos=True,
                                         temperature=0.0, timeout=120):
            first = first or time.perf_counter()
            n += len(chunk.token_ids)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, (time.perf_counter() - start) * 1e3
    assert first is not None
    return "OK", (time.perf_counter() - first) * 1e3 / max(1, n - 1)


async def overload(target: str, max_inflight: int, factor: int = 10, max_tokens: int = 32) -> OverloadResult:
    """max_inflight streams alone (TPOT unloaded), then factor x as many at once."""
    async with AsyncClient(target) as client:
        alone = await asyncio.gather(*(_tpot(client, i, max_tokens) for i in range(max_inflight)))
        crowd = await asyncio.gather(*(_tpot(client, i, max_tokens) for i in range(factor * max_inflight)))
    refusals = sorted(ms for code, ms in crowd if code == "RESOURCE_EXHAUSTED")
    admitted = [ms for code, ms in crowd if code == "OK"]
    other: dict[str, int] = {}
    for code, _ in crowd:
        if code not in ("OK", "RESOURCE_EXHAUSTED"):
            other[code] = other.get(code, 0) + 1
    return OverloadResult(
        offered=len(crowd), admitted=len(admitted), refused=len(refusals),
        refusal_ms_p50=refusals[len(refusals) // 2] if refusals else math.nan,
        refusal_ms_max=refusals[-1] if refusals else math.nan,
        tpot_ms_unloaded=sum(ms for _, ms in alone) / len(alone),
        tpot_ms_loaded=sum(admitted) / len(admitted) if admitted else math.nan, other=other)
