"""The serving simulator behind `pipeserve simulate`: a trace replayed through the REAL Scheduler,
admission policies and KV allocator, with a step-time model standing in for the GPU.

The pool is accounting-only (pages, promises, block tables; no tensors), requests are engine
Sequences whose "model" emits EOS when the trace's output length is reached, and each merge step
advances a virtual clock by the step-time model: the roofline floor of a model shape on a GPU
divided by an efficiency, or a linear model fitted to measured steps. Anything with the StepTime
signature plugs in. The command (flags, tables, plots) is pipeserve/capacity/simulate.py; the data
parallel x tensor parallel variant pipeserve/capacity/parallel.py.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pipeserve.bench.metrics import SLO, RequestRecord, stats, summarize
from pipeserve.bench.workload import TraceRequest
from pipeserve.capacity.roofline import CostModel
from pipeserve.config import EngineConfig
from pipeserve.engine.kv.policy import AdmissionPolicy, make_policy
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.kv.predicted import PredictedPolicy
from pipeserve.engine.kv.predictor import Features, OutputLengthPredictor
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
