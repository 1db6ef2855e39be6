"""`pipeserve simulate`: replay a trace through the serving simulator (pipeserve/capacity/simulator.py:
the real Scheduler, admission policies and KV allocator, a step-time model standing in for the GPU);
`--parallel` runs the data parallel x tensor parallel variant (pipeserve/capacity/parallel.py).

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
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from pipeserve.bench.metrics import SLO
from pipeserve.bench.report import (
    Panel,
    Series,
    cdf_series,
    machine_info,
    plot_panels,
    print_table,
    write_json,
)
from pipeserve.bench.workload import load_trace, trace_paths
from pipeserve.capacity import parallel
from pipeserve.capacity.gpus import GIB, GPU
from pipeserve.capacity.roofline import KV_DTYPES, WEIGHT_DTYPES, ModelShape, cost_model
from pipeserve.capacity.simulator import (
    POLICIES,
    LinearStepTime,
    Replay,
    RooflineStepTime,
    ServeSpec,
    StepTime,
    accuracy,
    at_rate,
    features,
    find_capacity,
    fits,
    own_rate,
    policy_factory,
    simulate,
    time_predictor,
    train,
)
from pipeserve.config import EngineConfig
from pipeserve.engine.kv.predictor import PROMPT_LENGTH_ONLY, OutputLengthPredictor


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
    parallel.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    if args.parallel:
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
