"""`pipeserve simulate --parallel DPxTP,...`: data parallel x tensor parallel on a node of GPUs, with
the serving simulator (pipeserve/capacity/simulator.py) standing in for each engine.

Tensor parallelism (T ranks) shards every linear layer, the attention heads and the vocabulary over
T GPUs: a rank reads 1/T of the weights and computes 1/T of the FLOPs; its KV cache holds its share
of the KV heads (all of one head when there are fewer KV heads than ranks: they are replicated).
The price is communication: two all-reduces per layer (after o_proj and after down_proj) of the
step's activations, and one all-gather of the logits rows, each costing the interconnect's latency
plus the ring's 2 (T - 1) / T (all-reduce) or (T - 1) / T (all-gather) of the bytes over its
per-GPU bandwidth, not overlapped with compute (as in vLLM's default path). A step of a T-way engine
takes roofline(shard) / efficiency + communication + the per-step overhead.

Data parallelism (N engines) splits the requests: engine i replays every N-th request of the trace
in arrival order (the gateway routes by load; with requests drawn from one trace, round robin is
what least-loaded routing converges to), each with the whole KV pool of its T GPUs; the metrics
are those of all requests together.

For each DP x TP it reports the batch-1 decode step (latency: where TP wins), the replay at the given
rate and, with --capacity, the highest rate within the SLOs (throughput: where DP wins unless the
model leaves no room for KV on fewer GPUs). A configuration whose weights do not fit its GPUs, or
whose KV pool cannot hold one context, is reported as not fitting.

Interconnects (datasheet figures; latencies are assumptions, override them with flags):
- nvlink4: NVLink 4 through NVSwitch on an HGX H100 / H200 board, 900 GB/s per GPU both directions
  together (NVIDIA H100 datasheet), 450 GB/s each way; 10 us per collective assumed.
- pcie5: PCIe Gen5 x16, 64 GB/s each way (H100 PCIe boards without an NVLink bridge); 25 us assumed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from pipeserve.bench.metrics import SLO, summarize
from pipeserve.bench.report import machine_info, print_table, write_json
from pipeserve.bench.workload import TraceRequest, load_trace, trace_paths
from pipeserve.capacity.gpus import GIB, GPU
from pipeserve.capacity.roofline import CostModel, ModelShape, cost_model
from pipeserve.capacity.simulator import (
    Replay,
    ServeSpec,
    at_rate,
    find_capacity,
    fits,
    own_rate,
    policy_factory,
    simulate,
)
from pipeserve.engine.kv.policy import AdmissionPolicy

ACTIVATION_BYTES = 2.0  # bf16 activations on the wire


@dataclass(frozen=True)
class Interconnect:
    name: str
    bandwidth: float  # bytes/s per GPU, each direction
    latency: float  # seconds per collective

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        """Ring all-reduce of nbytes over ranks GPUs (0 on one)."""
        if ranks == 1:
            return 0.0
        return self.latency + 2.0 * (ranks - 1) / ranks * nbytes / self.bandwidth

    def all_gather(self, nbytes: float, ranks: int) -> float:
        """Ring all-gather whose result is nbytes."""
        if ranks == 1:
            return 0.0
        return self.latency + (ranks - 1) / ranks * nbytes / self.bandwidth


INTERCONNECTS: dict[str, Interconnect] = {
    "nvlink4": Interconnect("NVLink 4 / NVSwitch", 450e9, 10e-6),
    "pcie5": Interconnect("PCIe Gen5 x16", 64e9, 25e-6),
}


def sharded(cost: CostModel, shape: ModelShape, ranks: int) -> CostModel:
    """One rank's share of a T-way tensor-parallel model: weights, FLOPs and KV heads split T ways
    (KV heads replicated when fewer than T); per-GPU memory and rates unchanged."""
    kv_share = max(1, shape.num_kv_heads // ranks) / shape.num_kv_heads
    return replace(
        cost,
        weight_bytes=cost.weight_bytes / ranks,
        weight_bytes_read=cost.weight_bytes_read / ranks,
        kv_bytes_per_token=cost.kv_bytes_per_token * kv_share,
        gemm_flops_per_token=cost.gemm_flops_per_token / ranks,
        lm_head_flops=cost.lm_head_flops / ranks,
        attn_flops_per_pair=cost.attn_flops_per_pair / ranks,
        expert_bytes=cost.expert_bytes / ranks,
    )


@dataclass(frozen=True)
class TensorParallelStepTime:
    """A merge step of a T-way engine: the shard's roofline / efficiency, then its collectives."""

    shard: CostModel
    ranks: int
    link: Interconnect
    hidden_size: int
    num_layers: int
    vocab_size: int
    efficiency: float = 0.8
    overhead_s: float = 0.0

    def communication(self, tokens: int, logit_rows: int) -> float:
        reduce = self.link.all_reduce(tokens * self.hidden_size * ACTIVATION_BYTES, self.ranks)
        gather = self.link.all_gather(logit_rows * self.vocab_size * ACTIVATION_BYTES, self.ranks)
        return 2 * self.num_layers * reduce + gather

    def __call__(self, decode_contexts: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> float:
        compute = self.shard.step(decode_contexts, prefill_chunks).t / self.efficiency
        tokens = len(decode_contexts) + sum(n for n, _ in prefill_chunks)
        rows = len(decode_contexts) + len(prefill_chunks)
        return compute + self.communication(tokens, rows) + self.overhead_s


def replay_data_parallel(
    requests: Sequence[TraceRequest], engines: int, policy: Callable[[], AdmissionPolicy],
    step_time: TensorParallelStepTime, spec: ServeSpec,
) -> dict[str, Any]:
    """Engine i replays requests[i::engines]; the metrics of every request together."""
    replays: list[Replay] = [simulate(requests[i::engines], policy(), step_time, spec) for i in range(engines)
                             if requests[i::engines]]
    records = [r for replay in replays for r in replay.records]
    duration = max(r.chunk_times[-1] for r in records) - min(r.send_time for r in records)
    out = summarize(records, duration, spec.slo)
    out["preemptions"] = sum(replay.summary["preemptions"] for replay in replays)
    return out


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """"8x1,4x2" -> [(8, 1), (4, 2)] (data parallel x tensor parallel)."""
    out = []
    for part in text.split(","):
        dp, _, tp = part.strip().lower().partition("x")
        if not (dp.isdigit() and tp.isdigit() and int(dp) >= 1 and int(tp) >= 1):
            raise ValueError(f"--parallel takes DPxTP pairs such as 4x2, got {part!r}")
        out.append((int(dp), int(tp)))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """simulate's flags for this mode (the rest are simulate's own)."""
    parser.add_argument("--parallel", metavar="DPxTP,...",
                        help="compare data parallel x tensor parallel layouts (e.g. 8x1,4x2,2x4,1x8): "
                        "each engine on TP GPUs, DP engines")
    parser.add_argument("--interconnect", default="nvlink4", choices=list(INTERCONNECTS),
                        help="with --parallel: the GPUs' link for the tensor-parallel collectives")
    parser.add_argument("--link-gbps", type=float, help="with --parallel: the link's GB/s each way "
                        "(default: the interconnect's datasheet figure)")
    parser.add_argument("--collective-latency-us", type=float,
                        help="with --parallel: microseconds per all-reduce or all-gather (default: "
                        "the interconnect's assumed figure)")


def main(args: argparse.Namespace) -> int:
    try:
        shape, gpu, layouts = ModelShape.resolve(args.model), GPU.get(args.gpu), parse_layouts(args.parallel)
    except ValueError as e:
        raise SystemExit(f"pipeserve simulate: {e}") from None
    link = INTERCONNECTS[args.interconnect]
    link = replace(link, bandwidth=link.bandwidth if args.link_gbps is None else args.link_gbps * 1e9,
                   latency=link.latency if args.collective_latency_us is None
                   else args.collective_latency_us * 1e-6)
    names = [p.strip() for p in args.policy.split(",") if p.strip()]
    policy_name = names[0] if len(names) == 1 else "optimistic"
    slo = SLO(args.ttft_slo, args.tpot_slo)
    trace = load_trace(trace_paths(args.trace.split(",") if args.trace else None, "pipeserve simulate"))
    split = trace[0].arrival + args.start * (trace[-1].arrival - trace[0].arrival)
    window = [r for r in trace if r.arrival >= split and r.prompt_tokens < args.context][: args.requests]
    if not window:
        raise SystemExit("pipeserve simulate: no request left to replay")
    rate = args.rate or own_rate(window)
    full = cost_model(shape, gpu, args.wdtype, args.kv_dtype)
    result: dict[str, Any] = {
        "machine": machine_info(),
        "config": {"model": shape.name, "gpu": asdict(gpu), "interconnect": asdict(link),
                   "wdtype": args.wdtype, "kvdtype": args.kv_dtype, "policy": policy_name,
                   "context": args.context,
                   "efficiency": args.efficiency, "step_overhead_ms": args.step_overhead_ms,
                   "slo": asdict(slo), "requests": len(window), "rate": rate},
        "layouts": [],
    }
    print(f"{shape.name} on {gpu.name} x {{DP x TP}} over {link.name} ({link.bandwidth / 1e9:.0f} GB/s, "
          f"{link.latency * 1e6:.0f} us): {len(window)} requests at {rate:.3g} req/s, policy {policy_name}")
    for dp, tp in layouts:
        shard = sharded(full, shape, tp)
        kv_tokens = shard.kv_capacity_tokens(args.gpu_memory_utilization)
        entry: dict[str, Any] = {"dp": dp, "tp": tp, "gpus": dp * tp, "kv_tokens_per_engine": kv_tokens,
                                 "weights_gib_per_gpu": shard.weight_bytes / GIB}
        result["layouts"].append(entry)
        if kv_tokens < args.context:
            entry["fits"] = False
            continue
        entry["fits"] = True
        step = TensorParallelStepTime(shard, tp, link, shape.hidden_size, shape.num_layers, shape.vocab_size,
                                      args.efficiency, args.step_overhead_ms / 1e3)
        entry["decode_step_ms"] = {"batch_1": step([1024], []) * 1e3, "batch_64": step([1024] * 64, []) * 1e3,
                                   "comm_batch_1": step.communication(1, 1) * 1e3}
        spec = ServeSpec(kv_tokens // args.page_size, args.page_size, args.context, args.max_tokens,
                         args.max_num_seqs, args.max_num_batched_tokens, slo)
        served = [r for r in window if fits(r, spec)]
        make = policy_factory(policy_name, None, float(args.quantile.split(",")[0]))

        def run(r: float, served: list[TraceRequest] = served, dp: int = dp, spec: ServeSpec = spec,
                step: TensorParallelStepTime = step, make: Callable[[], AdmissionPolicy] = make) -> Replay:
            return Replay(replay_data_parallel(at_rate(served, r), dp, make, step, spec), [])

        entry["at_rate"] = run(rate).summary
        if args.capacity:
            best, points = find_capacity(run, rate, args.attainment, args.tolerance, max_runs=20)
            entry["capacity"] = {"rate": best, "points": points}
    print_layouts(result)
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    return 0


def print_layouts(result: dict[str, Any]) -> None:
    rows = []
    for e in result["layouts"]:
        if not e["fits"]:
            rows.append([f"{e['dp']}x{e['tp']}", e["gpus"], e["weights_gib_per_gpu"],
                         e["kv_tokens_per_engine"], "does not fit", None, None, None, None, None])
            continue
        s, d = e["at_rate"], e["decode_step_ms"]
        rows.append([f"{e['dp']}x{e['tp']}", e["gpus"], e["weights_gib_per_gpu"], e["kv_tokens_per_engine"],
                     d["batch_1"], d["batch_64"], s["slo_attainment"], s["ttft_s"]["p50"],
                     None if s["tpot_s"]["p50"] is None else s["tpot_s"]["p50"] * 1e3,
                     e.get("capacity", {}).get("rate")])
    rate = result["config"]["rate"]
    print_table(f"{result['config']['model']}: DP x TP at {rate:.3g} req/s (decode steps at context 1024)",
                ["DPxTP", "GPUs", "weights GiB/GPU", "KV tokens/engine", "step b1 ms", "step b64 ms",
                 "SLO attainment", "TTFT p50 s", "TPOT p50 ms", "capacity req/s"], rows)
