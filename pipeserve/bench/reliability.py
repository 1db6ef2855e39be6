"""`pipeserve bench reliability`: fault, overload, abort-storm and bad-input figures of a real pipeline.

Starts `pipeserve up` (stories260K or any --model; the demo model when none), then runs each scenario
against it over gRPC and prints cases tried and passed, streams aborted
and state left, overload refusals and their latency, RSS growth per process (a short soak, see
pipeserve/bench/soak.py), faults injected and streams hung (last: it kills processes). Overload runs
on a second pipeline started with a small --max-inflight. The HTTP cases (pipeserve/bench/
hostile_http.py: bad requests, clients that leave, slow headers, heavy logprob streams beside a
liveness probe, the log checked for tracebacks) run on the first pipeline's OpenAI API and are
reported beside the gRPC ones. tests/reliability/ runs the same scenarios with smaller sizes and
asserts on them.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import signal
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pipeserve.bench import hostile_http
from pipeserve.bench.report import machine_info, print_table, write_json
from pipeserve.bench.shapes import stories260k
from pipeserve.bench.soak import PROMPTS, plot_soak, soak
from pipeserve.gateway.client import AsyncClient, build_request
from pipeserve.gateway.pb import generation_pb2 as pb
from pipeserve.local_cluster import LocalCluster

GENERATE = "/pipeserve.v1.Generation/Generate"


# ---- bad input ------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    request: bytes  # a serialized GenerateRequest (or bytes that are not one)
    code: str  # the expected grpc status name; "OK" when the request is served
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
        Case(
            "prompt beyond the context", _req("Once upon a time " * context_len), "INVALID_ARGUMENT", "prompt"
        ),
        Case(
            "no input at all",
            pb.GenerateRequest(max_tokens=2).SerializeToString(),
            "INVALID_ARGUMENT",
            "prompt",
        ),
        Case("prompt_token_ids empty", _req([]), "INVALID_ARGUMENT", "prompt_token_ids"),
        Case("prompt_token_ids out of vocab", _req([1, vocab_size]), "INVALID_ARGUMENT", "prompt_token_ids"),
        Case("prompt_token_ids 2**32-1", _req([1, 2**32 - 1]), "INVALID_ARGUMENT", "prompt_token_ids"),
        Case(
            "prompt_token_ids beyond the context",
            _req([1] * (context_len + 1)),
            "INVALID_ARGUMENT",
            "prompt_token_ids",
        ),
        Case("max_tokens 0", _req(max_tokens=0), "INVALID_ARGUMENT", "max_tokens"),
        # Refused with what the context leaves (3 tokens here), not silently cut short.
        Case(
            "max_tokens beyond the context",
            _req([1] * (context_len - 3), max_tokens=2**32 - 1, temperature=0.0),
            "INVALID_ARGUMENT",
            "at most 3 can be generated",
        ),
        Case(
            "max_tokens filling the context",
            _req([1] * (context_len - 3), max_tokens=3, temperature=0.0),
            "OK",
            "",
        ),
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
        Case(
            "frequency_penalty below -2",
            _req(frequency_penalty=-3.0),
            "INVALID_ARGUMENT",
            "frequency_penalty",
        ),
        # seed is uint64 on the wire: a client's int64 -1 arrives as 2**64-1.
        Case("seed negative (int64 -1)", _req(seed=2**64 - 1), "INVALID_ARGUMENT", "seed"),
        Case(
            "min_tokens above max_tokens", _req(max_tokens=2, min_tokens=3), "INVALID_ARGUMENT", "min_tokens"
        ),
        Case("1,000 stop strings", _req(stop=["s"] * 1000), "INVALID_ARGUMENT", "stop"),
        Case("a 1 MB stop string", _req(stop=["x" * 2**20]), "INVALID_ARGUMENT", "stop"),
        Case("an empty stop string", _req(stop=[""]), "INVALID_ARGUMENT", "stop"),
        Case("65 stop_token_ids", _req(stop_token_ids=list(range(65))), "INVALID_ARGUMENT", "stop_token_ids"),
        Case("logprobs above the limit", _req(logprobs=10_000), "INVALID_ARGUMENT", "logprobs"),
        Case("invalid UTF-8 in prompt bytes", invalid_utf8, "INVALID_ARGUMENT", "prompt"),
        Case("unknown chat role", _req([{"role": "wizard", "content": "hi"}]), "INVALID_ARGUMENT", "role"),
        Case("empty chat role", _req([{"role": "", "content": "hi"}]), "INVALID_ARGUMENT", "role"),
        Case(
            "empty messages list",
            pb.GenerateRequest(messages=pb.ChatMessages()).SerializeToString(),
            "INVALID_ARGUMENT",
            "messages",
        ),
        Case(
            "1,025 messages", _req([{"role": "user", "content": "hi"}] * 1025), "INVALID_ARGUMENT", "messages"
        ),
        Case("request_id of 257 characters", _req(request_id="r" * 257), "INVALID_ARGUMENT", "request_id"),
        Case(
            "a 5 MB prompt (over --max-request-bytes)", _req("x" * (5 * 2**20)), "INVALID_ARGUMENT", "prompt"
        ),
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
            results.append(
                CaseResult(
                    case.name,
                    case.code,
                    code,
                    details[:200],
                    code == case.code and case.field in details,
                    (time.perf_counter() - start) * 1e3,
                )
            )
        # A duplicate of an id in flight: ALREADY_EXISTS naming request_id; the first stream is unharmed.
        first = client.stream(PROMPTS[0], request_id="dup-id", max_tokens=64, ignore_eos=True)
        await first.read()
        start = time.perf_counter()
        code, details = await _call(channel, _req(request_id="dup-id", max_tokens=2))
        results.append(
            CaseResult(
                "duplicate request_id in flight",
                "ALREADY_EXISTS",
                code,
                details,
                code == "ALREADY_EXISTS" and "request_id" in details,
                (time.perf_counter() - start) * 1e3,
            )
        )
        first.cancel()
        start = time.perf_counter()
        found = await client.abort("no-such-request")
        results.append(
            CaseResult(
                "Abort of an unknown id",
                "OK found=False",
                f"OK found={found}",
                "",
                not found,
                (time.perf_counter() - start) * 1e3,
            )
        )
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
                call = client.stream(
                    PROMPTS[i % len(PROMPTS)],
                    max_tokens=max_tokens,
                    ignore_eos=True,
                    temperature=1.0,
                    request_id=f"storm-{seed}-{i}",
                    timeout=120,
                )
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


# ---- overload -------------------------------------------------------------------------------
@dataclass
class OverloadResult:
    limit: int  # the gateway's --max-inflight
    sustained_per_s: float  # `limit` streams over their unloaded end-to-end time
    offered_per_s: float  # the arrival rate offered (factor x sustained, as far as the client kept up)
    offered: int
    admitted: int
    refused: int
    refusal_ms_p50: float
    refusal_ms_max: float
    tpot_ms_unloaded: float
    tpot_ms_loaded: float
    other: dict[str, int]  # calls that ended neither OK nor RESOURCE_EXHAUSTED, by status


@dataclass
class _Timed:
    code: str  # "OK" or the status name
    ms: float  # from the call until it ended
    tpot_ms: float  # per output token after the first (OK calls)


async def _timed(client: AsyncClient, i: int, max_tokens: int) -> _Timed:
    """One greedy ignore_eos stream, timed."""
    start, first, n = time.perf_counter(), None, 0
    try:
        async for chunk in client.stream(
            PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, ignore_eos=True, temperature=0.0, timeout=120
        ):
            first = first or time.perf_counter()
            n += len(chunk.token_ids)
    except grpc.aio.AioRpcError as exc:
        return _Timed(exc.code().name, (time.perf_counter() - start) * 1e3, math.nan)
    end = time.perf_counter()
    return _Timed("OK", (end - start) * 1e3, (end - (first or end)) * 1e3 / max(1, n - 1))


async def overload(
    target: str, limit: int, factor: int = 10, max_tokens: int = 128, seconds: float = 3.0
) -> OverloadResult:
    """`limit` streams alone give the unloaded TPOT and the rate the server sustains (limit streams per
    end-to-end time); then calls arrive open-loop at factor x that rate for `seconds`, each timed on
    its own. One instant burst of factor x limit calls from this event loop would time the loop's
    own work instead: all the refusals land together once the client has sent the whole burst and the
    gateway has answered it (~10 ms for 36 calls on an idle machine, several times that on a loaded
    one), while one refusal costs the gateway ~0.2 ms of CPU. The stream length sets the rate: on a
    saturated 2-core machine the refusal latency follows the calls/s this client and the gateway
    must handle, so max_tokens is a realistic 128 rather than a rate-inflating 32."""
    async with AsyncClient(target) as client:
        alone = await asyncio.gather(*(_timed(client, i, max_tokens) for i in range(limit)))
        sustained = limit / (max(c.ms for c in alone) / 1e3)
        loop = asyncio.get_running_loop()
        start, tasks = loop.time(), list[asyncio.Task[_Timed]]()
        while loop.time() - start < seconds:
            tasks.append(asyncio.create_task(_timed(client, len(tasks), max_tokens)))
            await asyncio.sleep(max(0.0, start + len(tasks) / (factor * sustained) - loop.time()))
        offered_per_s = len(tasks) / (loop.time() - start)
        crowd = await asyncio.gather(*tasks)
    refusals = sorted(c.ms for c in crowd if c.code == "RESOURCE_EXHAUSTED")
    admitted = [c.tpot_ms for c in crowd if c.code == "OK"]
    other: dict[str, int] = {}
    for c in crowd:
        if c.code not in ("OK", "RESOURCE_EXHAUSTED"):
            other[c.code] = other.get(c.code, 0) + 1
    return OverloadResult(
        limit=limit,
        sustained_per_s=sustained,
        offered_per_s=offered_per_s,
        offered=len(crowd),
        admitted=len(admitted),
        refused=len(refusals),
        refusal_ms_p50=statistics.median(refusals) if refusals else math.nan,
        refusal_ms_max=refusals[-1] if refusals else math.nan,
        tpot_ms_unloaded=statistics.fmean(c.tpot_ms for c in alone),
        tpot_ms_loaded=statistics.fmean(admitted) if admitted else math.nan,
        other=other,
    )


# ---- process faults -------------------------------------------------------------------------
FAULT_PROCESSES = ("tokenizer", "detokenizer", "engine")
HANG_SECONDS = 5.0  # a stream that gets neither a message nor its end for this long after a fault hangs


@dataclass
class FaultResult:
    process: str
    streams: int
    outcomes: dict[str, int]  # "OK" (completed), "UNAVAILABLE", "HUNG" (cancelled by us), ...
    seconds_to_end: float  # from the kill until the last stream it broke ended
    health: list[str]  # the health statuses seen from the kill until SERVING again
    restarted: bool  # the killed process is gone and a new one of its kind runs
    serves_after: bool  # a new request completed afterwards

    @property
    def hung(self) -> int:
        return self.outcomes.get("HUNG", 0)


async def fault_under_load(
    pipe: LocalCluster, name: str, streams: int = 16, max_tokens: int = 400
) -> FaultResult:
    """SIGKILL the first `name` process while `streams` streams run (4 of them already producing).
    Streams the fault did not break (a tokenizer's started ones) run to completion. max_tokens is long
    enough that no stream can finish between its first token and the kill, however fast the engine."""
    async with AsyncClient(pipe.target, **pipe.security) as client:
        calls = [
            client.stream("Once upon a time", max_tokens=max_tokens, ignore_eos=True) for _ in range(streams)
        ]
        for call in calls[:4]:
            await call.read()
        victim = pipe.pids(name)[0]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()

        async def drain(call: Any) -> tuple[str, float]:
            try:
                while (await asyncio.wait_for(call.read(), HANG_SECONDS)) is not grpc.aio.EOF:
                    pass
            except TimeoutError:
                call.cancel()
                return "HUNG", time.monotonic() - killed
            except grpc.aio.AioRpcError as exc:
                return exc.code().name, time.monotonic() - killed
            return "OK", time.monotonic() - killed

        results = await asyncio.gather(*(drain(c) for c in calls))
        seen = [await client.health()]
        deadline = time.monotonic() + 90
        while (
            seen[-1] != "SERVING" or victim in pipe.pids(name) or not pipe.pids(name)
        ) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            if (status := await client.health()) != seen[-1]:
                seen.append(status)
        try:
            after = await client.generate("Once upon a time", max_tokens=3, temperature=0.0, timeout=30)
            serves = after.completion_tokens == 3
        except grpc.aio.AioRpcError:
            serves = False
    codes = [code for code, _ in results]
    return FaultResult(
        process=name,
        streams=streams,
        outcomes={code: codes.count(code) for code in sorted(set(codes))},
        seconds_to_end=max((t for code, t in results if code != "OK"), default=0.0),
        health=seen,
        restarted=victim not in pipe.pids(name) and bool(pipe.pids(name)),
        serves_after=serves,
    )


# ---- report ---------------------------------------------------------------------------------
def _left(state: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in state.items() if v) or "none"


def report_rows(figures: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(scenario, figure, value) rows: every figure the report shows."""
    bad, storm, over, soak = (figures[k] for k in ("bad_input", "abort_storm", "overload", "soak"))
    faults: list[FaultResult] = figures["faults"]
    outcomes = storm.outcomes
    http = figures["http"]
    slow, heavy = http["slow_headers"], http["heavy"]
    probe = heavy["health"]
    rows = [
        ("bad input (gRPC)", "cases tried / passed", f"{bad['tried']} / {bad['passed']}"),
        ("bad input (gRPC)", "state left", _left(bad["state_left"])),
        ("bad input (HTTP)", "cases tried / passed", f"{http['tried']} / {http['passed']}"),
        ("disconnects (HTTP)", "clients that left / state left",
         f"{http['disconnects']} / {_left(http['disconnect_state_left'])}"),
        ("slow headers (HTTP)", "connections / closed by the server",
         f"{slow['connections']} / {slow['closed']} (the last after {slow['closed_after_s_max']:.1f} s)"),
        ("heavy logprobs (HTTP)", "/health p50 / p99 / max beside them",
         f"{probe['p50_ms']:.1f} / {probe['p99_ms']:.1f} / {probe['max_ms']:.1f} ms ({probe['probes']} "
         f"probes, {heavy['health_not_ok']} not 200; {heavy['streams']} streams of n {heavy['n']} x "
         f"{heavy['tokens']} tokens, logprobs 20)"),
        ("HTTP, all of it", "tracebacks / ERROR lines in the log / state left",
         f"{http['log_tracebacks']} / {http['log_errors']} / {_left(http['state_left'])}"),
        (
            "abort storm",
            "streams / cancelled / completed",
            f"{storm.streams:,} / {outcomes.get('CANCELLED', 0):,} / {outcomes.get('completed', 0):,}",
        ),
        ("abort storm", "state left", _left(storm.state_left)),
        (
            "overload",
            "offered",
            f"{over.offered} calls at {over.offered_per_s:.1f}/s "
            f"({over.offered_per_s / over.sustained_per_s:.1f}x the sustained {over.sustained_per_s:.1f}/s, "
            f"--max-inflight {over.limit})",
        ),
        ("overload", "admitted / refused / other", f"{over.admitted} / {over.refused} / {over.other or 0}"),
        (
            "overload",
            "refusal latency p50 / max",
            f"{over.refusal_ms_p50:.1f} / {over.refusal_ms_max:.1f} ms",
        ),
        ("overload", "TPOT unloaded / loaded", f"{over.tpot_ms_unloaded:.1f} / {over.tpot_ms_loaded:.1f} ms"),
        ("overload", "state left", _left(figures["overload_state_left"])),
    ]
    rows += [
        (
            "soak",
            f"RSS {g.process}",
            f"{g.first_mb:.1f} -> {g.last_mb:.1f} MiB, "
            f"{g.slope_mb_per_min:+.2f} MiB/min (2nd half), {g.kib_per_request:+.2f} KiB/request",
        )
        for g in soak.growth
    ]
    rows += [
        (
            "soak",
            "verdict",
            f"{soak.verdict} (threshold {soak.threshold_mb_per_min:g} MiB/min; {soak.seconds:.0f} s, "
            f"{sum(soak.requests.values()):,} requests at {soak.requests_per_s:.1f}/s)",
        ),
        ("soak", "KV pages at the end / state left", f"{soak.pages_at_end:g} / {_left(soak.state_left)}"),
        (
            "faults",
            "injected / streams hung",
            f"{len(faults)} SIGKILLs / {sum(f.hung for f in faults)} of {sum(f.streams for f in faults)}",
        ),
    ]
    rows += [
        (
            "faults",
            f"SIGKILL {f.process}",
            f"{f.outcomes}, broken streams ended in {f.seconds_to_end:.2f} s, "
            f"health {' -> '.join(f.health)}, restarted {f.restarted}, serves after {f.serves_after}",
        )
        for f in faults
    ]
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=stories260k(),
        help="checkpoint dir (default: the shared stories260K, else the demo model)",
    )
    parser.add_argument("--streams", type=int, default=1000, help="abort-storm streams")
    parser.add_argument("--soak-seconds", type=float, default=60.0, help="the short soak's length")
    parser.add_argument("--overload-limit", type=int, default=4, help="--max-inflight of the overload run")
    parser.add_argument(
        "--overload-seconds", type=float, default=3.0, help="how long 10x the load is offered"
    )
    parser.add_argument("--fault-streams", type=int, default=16, help="streams open at each SIGKILL")
    parser.add_argument("--json", metavar="PATH", help="write every figure (soak samples included) as JSON")
    parser.add_argument("--out", metavar="DIR", help="write the soak's plot (soak.png) into DIR")


def main(args: argparse.Namespace) -> int:
    figures: dict[str, Any] = {
        "machine": machine_info(),
        "model": args.model or "demo",
        "load_average_before": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory(prefix="pipeserve-reliability-") as tmp:
        pipe = LocalCluster(Path(tmp) / "up.log", args.model)
        try:
            results = asyncio.run(run_bad_inputs(pipe.target))
            figures["bad_input"] = {
                "tried": len(results),
                "passed": sum(r.passed for r in results),
                "failed": [asdict(r) for r in results if not r.passed],
                "state_left": pipe.wait_clean(),
            }
            figures["http"] = hostile_http.run(pipe)
            storm = asyncio.run(abort_storm(pipe.target, args.streams))
            storm.state_left = pipe.wait_clean()
            figures["abort_storm"] = storm
            figures["soak"] = asyncio.run(soak(pipe, args.soak_seconds))
            figures["faults"] = [
                asyncio.run(fault_under_load(pipe, name, args.fault_streams)) for name in FAULT_PROCESSES
            ]
        finally:
            pipe.stop()
        limit = ("--max-inflight", str(args.overload_limit))
        over = LocalCluster(Path(tmp) / "overload.log", args.model, *limit)
        try:
            figures["overload"] = asyncio.run(
                overload(over.target, args.overload_limit, seconds=args.overload_seconds)
            )
            figures["overload_state_left"] = over.wait_clean()
        finally:
            over.stop()
    figures["load_average_after"] = os.getloadavg()
    load = figures["load_average_before"][0], figures["load_average_after"][0]
    print_table(
        "pipeserve bench reliability",
        ["scenario", "figure", "value"],
        report_rows(figures),
        caption=f"{figures['model']}; 1-min load average {load[0]:.1f} before, {load[1]:.1f} after "
        f"({os.cpu_count()} cores)",
    )
    if args.out:
        print(f"wrote {plot_soak(figures['soak'], Path(args.out) / 'soak.png')}")
    if args.json:
        print(f"wrote {write_json(args.json, figures)}")
    return 0
