"""`pipeserve simulate`: replay a trace through the REAL Scheduler, admission policies and KV allocator,
with a step-time model standing in for the GPU.

The pool is accounting-only (pages, promises, block tables; no tensors), requests are engine
Sequences whose "model" emits EOS when the trace's output length is reached, and each merge step
advances a virtual clock by the step-time model: the roofline floor of a model shape on a GPU
divided by an efficiency, or a linear model fitted to measured steps. Anything with the StepTime
signature plugs in.

Policies: max, optimistic, predicted (future-peak admission) and predicted-reserve (the pool
promises prompt + predicted output to each request); see pipeserve/engine/kv/predicted.py.
A run reports per policy the serving metrics of pipeserve/bench/metrics.py (throughput, TTFT / TPOT
/ e2e percentiles, goodput and SLO attainment), preemptions and recomputed tokens, KV reserved vs
allocated vs holding tokens (time-weighted), and queueing time. `--capacity` searches, per policy,
the highest request rate whose SLO attainment stays at or above a target. The `predicted` policy's
predictor is trained on the trace before the replayed window (what a restarted server reloads from
its file) and scored on every later request against a prompt-length-only baseline.

Requests: max_tokens = min(--max-tokens, context - prompt), as typical clients send; prompts that
leave no room in the context, or do not fit the pool, are dropped and counted. The traces carry no
text: simulated prompts share one prefix, so the prefix-hash feature is constant here and the app
tag (the trace file) is what tells the two applications apart.

JSON (`--json PATH`): machine, config (model, gpu, dtypes, kv_tokens, num_pages, page_size, context,
slo, step model), trace (files, history/window sizes, dropped, rate), predictor (held-out accuracy,
us per call), runs[] (one per policy at --rate: policy, rate, the metrics summary, preemptions,
preempted_requests, recomputed_tokens, queue_s stats, kv {reserved, allocated, used (fractions of the
pool, time-weighted), waste (1 - used / reserved), time_over_90 (share of time >= 90% reserved)},
steps, sim_wall_s), capacity {policy: {rate, points[] (rate, slo_attainment, goodput)}}.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pipeserve.bench.gpus import GIB, GPU
from pipeserve.bench.metrics import SLO, RequestRecord, stats, summarize
from pipeserve.bench.report import (
    Panel,
    Series,
    cdf_series,
    machine_info,
    plot_panels,
    print_table,
    write_json,
)
from pipeserve.bench.roofline import KV_DTYPES, WEIGHT_DTYPES, CostModel, ModelShape, cost_model
from pipeserve.bench.workload import TraceRequest, load_trace, trace_paths
from pipeserve.config import EngineConfig
from pipeserve.engine.kv.policy import AdmissionPolicy, make_policy
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.kv.predicted import PredictedPolicy
from pipeserve.engine.kv.predictor import PROMPT_LENGTH_ONLY, Features, OutputLengthPredictor
from pipeserve.engine.scheduler import Scheduler
from pipeserve.engine.sequence import Sequence as Seq
from pipeserve.sampling_params import SamplingParams

EOS, TOKEN = 2, 3  # what the simulated model emits
# `predicted-reserve`: the predicted policy with per-request promises instead of the future-peak check.
POLICIES = ("max", "optimistic", "predicted", "predicted-reserve")


# -- step time ----------------------------------------------------------------------------------
class StepTime(Protocol):
    def __call__(self, decode_contexts: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds for one merge step: decode rows with these KV lengths (new token included) and
        prefill chunks (tokens, tokens already cached)."""
        ...


@dataclass(frozen=True)
class RooflineStepTime:
    cost: CostModel
    efficiency: float = 0.8  # achieved fraction of the floor (~60-90% at batch 1 is typical)
    overhead_s: float = 0.0  # per step: scheduling, launches

    def __call__(self, decode_contexts: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> float:
        return self.cost.step(decode_contexts, prefill_chunks).t / self.efficiency + self.overhead_s


@dataclass(frozen=True)
class LinearStepTime:
    """t = base + per_token x tokens + per_kv_token x KV tokens read + per_pair x attention pairs,
    fitted by least squares to measured steps."""

    base_s: float
    per_token_s: float
    per_kv_token_s: float
    per_pair_s: float

    @staticmethod
    def terms(decode_contexts: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> tuple[int, ...]:
        kv = sum(decode_contexts) + sum(n + c for n, c in prefill_chunks)
        pairs = sum(decode_contexts) + sum(n * c + n * (n + 1) // 2 for n, c in prefill_chunks)
        return 1, len(decode_contexts) + sum(n for n, _ in prefill_chunks), kv, pairs

    def __call__(self, decode_contexts: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> float:
        _, tokens, kv, pairs = self.terms(decode_contexts, prefill_chunks)
        return self.base_s + self.per_token_s * tokens + self.per_kv_token_s * kv + self.per_pair_s * pairs

    @classmethod
    def fit(cls, steps: Sequence[tuple[Sequence[int], Sequence[tuple[int, int]], float]]) -> LinearStepTime:
        """From (decode_contexts, prefill_chunks, measured seconds) samples; coefficients >= 0."""
        x = np.array([cls.terms(d, p) for d, p, _ in steps], dtype=float)
        y = np.array([t for _, _, t in steps], dtype=float)
        scale = np.maximum(x.max(axis=0), 1.0)  # the terms span ten orders of magnitude
        coef = np.linalg.lstsq(x / scale, y, rcond=None)[0] / scale
        return cls(*(max(float(c), 0.0) for c in coef))

    @classmethod
    def from_json(cls, path: str | Path) -> LinearStepTime:
        return cls(**json.loads(Path(path).read_text()))


# -- what is served -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeSpec:
    num_pages: int
    page_size: int = EngineConfig.page_size
    context: int = 8192
    max_tokens: int = 2048  # what clients ask for, capped by the room left in the context
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    slo: SLO = SLO()


def fits(req: TraceRequest, spec: ServeSpec) -> bool:
    """The engine's own checks: room to generate one token, in the context and in the pool."""
    pages = -(-(req.prompt_tokens + 1) // spec.page_size)
    return req.prompt_tokens < spec.context and pages <= spec.num_pages


def make_sequence(rid: str, req: TraceRequest, spec: ServeSpec) -> Seq:
    params = SamplingParams(max_tokens=min(spec.max_tokens, spec.context - req.prompt_tokens))
    return Seq(rid, [0] * req.prompt_tokens, req.prompt_tokens, params, req.arrival, req.app,
               stop_ids=frozenset({EOS}))


def at_rate(requests: Sequence[TraceRequest], rate: float | None) -> list[TraceRequest]:
    """The requests from t = 0 with inter-arrival times scaled so the mean rate is `rate` (req/s); the
    trace's burstiness is kept. None: the trace's own rate."""
    if not requests:
        return []
    t0, span = requests[0].arrival, requests[-1].arrival - requests[0].arrival
    factor = 1.0 if rate is None or span <= 0 else (len(requests) - 1) / span / rate
    return [replace(r, arrival=(r.arrival - t0) * factor) for r in requests]


def own_rate(requests: Sequence[TraceRequest]) -> float:
    span = requests[-1].arrival - requests[0].arrival
    return (len(requests) - 1) / span if span > 0 else float("inf")


# -- one replay ---------------------------------------------------------------------------------
@dataclass
class Replay:
    summary: dict[str, Any]  # JSON-ready metrics
    records: list[RequestRecord]  # per request, in the order given


def simulate(requests: Sequence[TraceRequest], policy: AdmissionPolicy, step_time: StepTime,
             spec: ServeSpec) -> Replay:
    """Replay `requests` (sorted by arrival; each must fit) to completion."""
    started = time.perf_counter()
    pool = KVPool.accounting_only(spec.num_pages, spec.page_size, spec.max_num_seqs, spec.context)
    clock = 0.0

    def on_admit(seq: Seq) -> None:
        if seq.first_scheduled is None:
            seq.first_scheduled = clock

    sched = Scheduler(pool=pool, policy=policy, max_num_seqs=spec.max_num_seqs,
                      max_num_batched_tokens=spec.max_num_batched_tokens, max_model_len=spec.context,
                      on_admit=on_admit, on_release=lambda seq: None)
    pending = deque(enumerate(requests))
    targets: dict[Seq, int] = {}
    records: list[RequestRecord] = [RequestRecord(r.arrival, prompt_tokens=r.prompt_tokens, app=r.app)
                                    for r in requests]
    index: dict[Seq, int] = {}
    queue_s: list[float] = []
    rows = steps = 0
    kv = np.zeros(5)  # time-weighted: reserved, allocated, cached tokens; time >= 90% reserved; total time
    full = 0.9 * spec.num_pages * spec.page_size
    preempted: set[Seq] = set()
    idle_steps = 0
    while pending or sched.has_work():
        while pending and pending[0][1].arrival <= clock:
            i, req = pending.popleft()
            seq = make_sequence(str(i), req, spec)
            targets[seq], index[seq] = req.output_tokens, i
            sched.add(seq)
        if not sched.has_work():
            clock = pending[0][1].arrival
            continue
        before = sched.num_preemptions
        batch = sched.schedule()
        if not batch.num_tokens:
            idle_steps += 1
            if idle_steps > 2:  # nothing runs and nothing can be admitted: a request larger than the pool
                raise RuntimeError(f"simulation stuck at t={clock:.3f}s with {len(sched.waiting)} waiting")
            continue
        idle_steps = 0
        if sched.num_preemptions > before:
            preempted.update(s for s in sched.waiting if s.num_preemptions)
        decode_ctx = [s.num_computed + 1 for s in batch.decode]
        chunks = [(n, s.num_computed) for s, n in zip(batch.prefill, batch.prefill_lens, strict=True)]
        rows += batch.num_tokens
        dt = step_time(decode_ctx, chunks)
        clock += dt
        steps += 1
        sampled = batch.sampling()
        tokens = [EOS if s.num_output + 1 >= targets[s] else TOKEN for s in sampled]
        for seq in sched.postprocess(batch, sampled, tokens):
            assert seq.first_scheduled is not None  # set when it was first scheduled, above
            queue_s.append(seq.first_scheduled - seq.arrival)
            del targets[seq]
        for seq in sampled:
            records[index[seq]].add_chunk(clock, 1)
        cached = sum(s.num_computed for s in sched.running)
        reserved = (pool.num_pages - pool.available) * pool.page_size
        allocated = (pool.num_pages - pool.num_free) * pool.page_size
        kv += dt * np.array([reserved, allocated, cached, reserved >= full, 1.0])
    duration = max(r.chunk_times[-1] for r in records) - min(r.send_time for r in records)
    out = summarize(records, duration, spec.slo)
    total = kv[4] * spec.num_pages * spec.page_size
    out.update(
        preemptions=sched.num_preemptions,
        preempted_requests=len(preempted),
        # Without preemption every token but the last output is run exactly once.
        recomputed_tokens=rows - sum(r.prompt_tokens + r.output_tokens - 1 for r in records),
        queue_s=stats(queue_s),
        kv={"reserved": kv[0] / total, "allocated": kv[1] / total, "used": kv[2] / total,
            "waste": 1.0 - kv[2] / kv[0] if kv[0] else 0.0, "time_over_90": kv[3] / kv[4]},
        steps=steps,
        sim_wall_s=time.perf_counter() - started,
    )
    return Replay(out, records)


# -- the predictor ------------------------------------------------------------------------------
def features(requests: Sequence[TraceRequest], spec: ServeSpec) -> list[tuple[Features, int]]:
    """(features, output tokens) of each request as the engine would see it when it finishes."""
    out = []
    for req in requests:
        seq = make_sequence("", req, spec)
        out.append((Features.of(seq), min(req.output_tokens, seq.params.max_tokens)))
    return out


def train(history: Sequence[tuple[Features, int]], **options: Any) -> OutputLengthPredictor:
    pred = OutputLengthPredictor(**options)
    for f, n in history:
        pred.update(f, n)
    return pred


def accuracy(pred: OutputLengthPredictor, heldout: Sequence[tuple[Features, int]]) -> dict[str, Any]:
    """Frozen predictor on held-out requests: MAE of the p50, how often the truth is <= the p90, and
    the mean p90 (what a p90 reservation costs); requests without a prediction count as max_tokens."""
    p50 = np.array([pred.predict(f, 0.5) or f.max_tokens for f, _ in heldout], dtype=float)
    p90 = np.array([pred.predict(f, 0.9) or f.max_tokens for f, _ in heldout], dtype=float)
    truth = np.array([n for _, n in heldout], dtype=float)
    return {"requests": len(heldout), "mae_p50": float(np.abs(p50 - truth).mean()),
            "p90_coverage": float((truth <= p90).mean()), "mean_p90": float(p90.mean()),
            "mean_truth": float(truth.mean())}


def time_predictor(pred: OutputLengthPredictor, sample: Sequence[tuple[Features, int]]) -> dict[str, float]:
    """Microseconds per predict and per update (on a copy: the caller's predictor is untouched)."""
    pred = OutputLengthPredictor.from_dict(pred.to_dict())
    t0 = time.perf_counter()
    for f, _ in sample:
        pred.predict(f, 0.9)
    t1 = time.perf_counter()
    for f, n in sample:
        pred.update(f, n)
    t2 = time.perf_counter()
    return {"predict_us": (t1 - t0) / len(sample) * 1e6, "update_us": (t2 - t1) / len(sample) * 1e6}


# -- policies, sweeps and capacity ---------------------------------------------------------------
def policy_factory(name: str, predictor: OutputLengthPredictor | None, quantile: float
                   ) -> Callable[[], AdmissionPolicy]:
    """Fresh policy per replay; `predicted` starts each one from the same trained state."""
    if not name.startswith("predicted"):
        return lambda: make_policy(name)
    state = (predictor or OutputLengthPredictor()).to_dict()
    mode = "reserve" if name == "predicted-reserve" else "peak"
    return lambda: PredictedPolicy(quantile=quantile, predictor=OutputLengthPredictor.from_dict(state),
                                   mode=mode)


def find_capacity(run: Callable[[float], Replay], start: float, target: float,
                  rel_tol: float = 0.03, max_runs: int = 14) -> tuple[float | None, list[dict[str, float]]]:
    """Highest rate whose SLO attainment is >= target: step by 1.5x to bracket it, then bisect
    geometrically. Returns (rate or None if even the lowest tried fails, every point tried)."""
    points: list[dict[str, float]] = []

    def ok(rate: float) -> bool:
        s = run(rate).summary
        points.append({"rate": rate, "slo_attainment": s["slo_attainment"], "goodput": s["goodput"]})
        return s["slo_attainment"] >= target

    lo = hi = None
    rate = start
    while len(points) < max_runs and (lo is None or hi is None):
        if ok(rate):
            lo, rate = rate, rate * 1.5
        else:
            hi, rate = rate, rate / 1.5
        if lo is None and rate < start / 50:
            break
    while lo is not None and hi is not None and hi / lo > 1 + rel_tol and len(points) < max_runs:
        mid = (lo * hi) ** 0.5
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, sorted(points, key=lambda p: p["rate"])


# -- CLI ----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", help="CSV file(s), comma-separated; default: every shared trace, mixed")
    parser.add_argument("--policy", default="max,optimistic,predicted",
                        help=f"a comma list of {', '.join(POLICIES)}")
    parser.add_argument("--model", default="llama-3-8b", help="roofline preset or HF config path")
    parser.add_argument("--gpu", default="L40S", help="GPU of the cost model (a roofline table entry)")
    parser.add_argument("--wdtype", default="bf16", choices=list(WEIGHT_DTYPES), help="weight dtype")
    parser.add_argument("--kv-dtype", default="bf16", choices=list(KV_DTYPES), help="KV cache dtype")
    parser.add_argument("--kv-gib", type=float, help="KV budget; default: GPU memory x utilization - weights")
    parser.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization,
                        help="fraction of GPU memory for weights and KV cache")
    parser.add_argument("--context", type=int, default=8192, help="the served context length")
    parser.add_argument("--max-tokens", type=int, default=2048, help="clients ask min(this, context-prompt)")
    parser.add_argument("--page-size", type=int, default=EngineConfig.page_size, help="tokens per KV page")
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs,
                        help="most sequences running in one step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                        help="most tokens in one step")
    parser.add_argument("--efficiency", type=float, default=0.8, help="achieved fraction of the floor")
    parser.add_argument("--step-overhead-ms", type=float, default=0.0,
                        help="fixed CPU cost added to every step")
    parser.add_argument("--step-model", metavar="JSON", help="a fitted LinearStepTime's JSON")
    parser.add_argument("--rate", type=float, help="mean req/s of the replay (default: the trace's)")
    parser.add_argument("--start", type=float, default=0.5,
                        help="fraction of the trace (by time) before the replay: the predictor's history")
    parser.add_argument("--requests", type=int, default=3000, help="requests replayed")
    parser.add_argument("--quantile", default=str(EngineConfig.predictor_quantile),
                        help="reservation quantile of `predicted`; a comma list runs one per value")
    parser.add_argument("--predictor", metavar="PATH", help="load this predictor instead of training one")
    parser.add_argument("--ttft-slo", type=float, default=SLO.ttft, help="time-to-first-token SLO, seconds")
    parser.add_argument("--tpot-slo", type=float, default=SLO.tpot, help="time-per-output-token SLO, seconds")
    parser.add_argument("--capacity", action="store_true", help="search each policy's best rate within SLOs")
    parser.add_argument("--attainment", type=float, default=0.9, help="SLO attainment the capacity must keep")
    parser.add_argument("--tolerance", type=float, default=0.03, help="relative precision of the capacity")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--out", metavar="DIR", help="write simulate.png (and capacity.png) here")
    from pipeserve.bench import parallel  # imports this module

    parallel.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    if args.parallel:
        from pipeserve.bench import parallel  # imports this module

        return parallel.main(args)
    try:
        shape = ModelShape.resolve(args.model)
        gpu = GPU.get(args.gpu)
    except ValueError as e:
        raise SystemExit(f"pipeserve simulate: {e}") from None
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not policies or set(policies) - set(POLICIES):
        raise SystemExit(f"pipeserve simulate: --policy takes a list of {', '.join(POLICIES)}")
    quantiles = [float(q) for q in args.quantile.split(",")]
    if not all(0 < q < 1 for q in quantiles):
        raise SystemExit("pipeserve simulate: --quantile values must be in (0, 1)")
    cost = cost_model(shape, gpu, args.wdtype, args.kv_dtype)
    kv_tokens = (int(args.kv_gib * GIB // cost.kv_bytes_per_token) if args.kv_gib is not None
                 else cost.kv_capacity_tokens(args.gpu_memory_utilization))
    if kv_tokens < args.page_size:
        raise SystemExit(f"pipeserve simulate: {shape.name} on {gpu.name} leaves {kv_tokens} tokens of KV")
    spec = ServeSpec(kv_tokens // args.page_size, args.page_size, args.context, args.max_tokens,
                     args.max_num_seqs, args.max_num_batched_tokens, SLO(args.ttft_slo, args.tpot_slo))
    step_time: StepTime = (LinearStepTime.from_json(args.step_model) if args.step_model
                           else RooflineStepTime(cost, args.efficiency, args.step_overhead_ms / 1e3))

    paths = trace_paths(args.trace.split(",") if args.trace else None, "pipeserve simulate")
    trace = load_trace(paths)
    split = trace[0].arrival + args.start * (trace[-1].arrival - trace[0].arrival)
    history = [r for r in trace if r.arrival < split and fits(r, spec)]
    later = [r for r in trace if r.arrival >= split and fits(r, spec)]
    window = later[: args.requests]
    if not window:
        raise SystemExit("pipeserve simulate: no request left to replay")
    dropped = sum(not fits(r, spec) for r in trace if split <= r.arrival <= window[-1].arrival)
    rate = args.rate or own_rate(window)

    result: dict[str, Any] = {"machine": machine_info()}
    result["config"] = {
        "model": shape.name, "gpu": asdict(gpu), "wdtype": args.wdtype, "kvdtype": args.kv_dtype,
        "kv_tokens": kv_tokens, "kv_gib": kv_tokens * cost.kv_bytes_per_token / GIB, **asdict(spec),
        "step_model": (f"linear fit {args.step_model}" if args.step_model
                       else f"roofline / {args.efficiency} + {args.step_overhead_ms} ms"),
        "quantiles": quantiles,
    }
    result["trace"] = {"files": [str(p) for p in paths], "history_requests": len(history),
                       "window_requests": len(window), "dropped_beyond_context_or_pool": dropped,
                       "trace_rate": own_rate(window), "rate": rate}
    print(f"{shape.name} on {gpu.name}: KV {kv_tokens:,} tokens ({result['config']['kv_gib']:.2f} GiB), "
          f"context {spec.context}, {len(window)} requests replayed at {rate:.3g} req/s "
          f"({dropped} dropped), predictor history {len(history)} requests")

    predictor = None
    if any(name.startswith("predicted") for name in policies):
        if args.predictor:
            predictor = OutputLengthPredictor.load(args.predictor)
        else:
            predictor = train(features(history, spec))
        heldout = features(later, spec)
        baseline = train(features(history, spec), levels=PROMPT_LENGTH_ONLY)
        result["predictor"] = {"keys": len(predictor), "predicted": accuracy(predictor, heldout),
                               "prompt_length_only": accuracy(baseline, heldout),
                               **time_predictor(predictor, heldout[:20000])}
        print_predictor(result["predictor"])

    makers = {}
    for name in policies:
        predicted = name.startswith("predicted")
        for q in quantiles if predicted else [0.0]:
            label = f"{name} q{q:g}" if predicted and len(quantiles) > 1 else name
            makers[label] = policy_factory(name, predictor, q)

    def run(label: str, r: float) -> Replay:
        return simulate(at_rate(window, r), makers[label](), step_time, spec)

    replays = {label: run(label, rate) for label in makers}
    result["runs"] = [{"policy": label, "rate": rate, **replays[label].summary} for label in makers]
    print_runs(result["runs"], f"at {rate:.3g} req/s")
    if args.capacity:
        result["capacity"] = {}
        for label in makers:
            best, points = find_capacity(partial(run, label), rate, args.attainment,
                                         args.tolerance, max_runs=30)
            result["capacity"][label] = {"rate": best, "points": points}
        print_capacity(result["capacity"], args.attainment, spec.slo)
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    if args.out:
        for path in plot(result, replays, Path(args.out)):
            print(f"wrote {path}")
    return 0


# -- output -------------------------------------------------------------------------------------
def print_predictor(p: dict[str, Any]) -> None:
    rows = [[name, a["requests"], a["mae_p50"], a["p90_coverage"], a["mean_p90"], a["mean_truth"]]
            for name, a in (("predicted", p["predicted"]), ("prompt length only", p["prompt_length_only"]))]
    print_table(f"output-length predictor on held-out requests ({p['keys']} keys; "
                f"{p['predict_us']:.2f} us / predict, {p['update_us']:.2f} us / update)",
                ["features", "requests", "MAE p50", "truth <= p90", "mean p90", "mean truth"], rows)


def print_runs(runs: list[dict[str, Any]], title: str) -> None:
    columns = ["metric", *(r["policy"] for r in runs)]
    rows = [
        ("SLO attainment", lambda r: r["slo_attainment"]),
        ("goodput req/s", lambda r: r["goodput"]),
        ("throughput req/s", lambda r: r["request_throughput"]),
        ("output tok/s", lambda r: r["output_throughput"]),
        ("TTFT p50 s", lambda r: r["ttft_s"]["p50"]),
        ("TTFT p99 s", lambda r: r["ttft_s"]["p99"]),
        ("TPOT p50 ms", lambda r: _ms(r["tpot_s"]["p50"])),
        ("TPOT p99 ms", lambda r: _ms(r["tpot_s"]["p99"])),
        ("e2e p50 s", lambda r: r["e2e_s"]["p50"]),
        ("e2e p99 s", lambda r: r["e2e_s"]["p99"]),
        ("queueing p50 s", lambda r: r["queue_s"]["p50"]),
        ("queueing p99 s", lambda r: r["queue_s"]["p99"]),
        ("preemptions", lambda r: r["preemptions"]),
        ("preempted requests", lambda r: r["preempted_requests"]),
        ("recomputed tokens", lambda r: r["recomputed_tokens"]),
        ("KV reserved (of pool)", lambda r: r["kv"]["reserved"]),
        ("KV holding tokens (of pool)", lambda r: r["kv"]["used"]),
        ("KV waste (reserved, unused)", lambda r: r["kv"]["waste"]),
        ("time with KV >= 90% reserved", lambda r: r["kv"]["time_over_90"]),
    ]
    print_table(f"policies side by side, {title}", columns, [[label, *map(f, runs)] for label, f in rows])


def print_capacity(capacity: dict[str, dict[str, Any]], attainment: float, slo: SLO) -> None:
    print_table(f"capacity: highest rate with >= {attainment:.0%} of requests within TTFT <= {slo.ttft:g} s "
                f"and TPOT <= {slo.tpot * 1e3:g} ms",
                ["policy", "req/s", "replays"],
                [[name, c["rate"], len(c["points"])] for name, c in capacity.items()])


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def plot(result: dict[str, Any], replays: dict[str, Replay], out: Path) -> list[Path]:
    """TTFT and TPOT distributions per policy at the replay rate; attainment vs rate when searched."""
    ttft = Panel("fraction of requests", xlabel="TTFT (s)", title="TTFT", logx=True)
    tpot = Panel("fraction of requests", xlabel="TPOT (ms)", title="TPOT")
    for i, (name, replay) in enumerate(replays.items()):
        done = [r for r in replay.records if r.ok]
        ttft.series.append(cdf_series(name, [r.ttft for r in done], color=f"C{i}"))
        tpots = [r.tpot * 1e3 for r in done if r.tpot is not None]
        tpot.series.append(cdf_series(name, tpots, color=f"C{i}"))
    rate = result["runs"][0]["rate"]
    paths = [plot_panels(out / "simulate.png", [ttft, tpot], title=f"{result['config']['model']} on "
                         f"{result['config']['gpu']['name']} at {rate:.3g} req/s")]
    if "capacity" in result:
        att = Panel("SLO attainment", xlabel="request rate (req/s)", title="attainment vs rate")
        for i, (name, c) in enumerate(result["capacity"].items()):
            att.series.append(Series(name, [p["rate"] for p in c["points"]],
                                     [p["slo_attainment"] for p in c["points"]], color=f"C{i}"))
        paths.append(plot_panels(out / "capacity.png", [att]))
    return paths
