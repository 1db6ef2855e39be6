"""The gateway's Prometheus metrics: one registry, served by HTTP `GET /metrics` and `--metrics-port`.

Serving series carry vLLM's names with a `pipeserve:` prefix (so its dashboards and the inference
routers that read queue depth and KV usage port by a rename) and vLLM's histogram buckets. Latencies
are measured where the client sees them, in the gateway, on every request whatever its front end
(gRPC or HTTP): time to first token and end-to-end from admission, inter-token latency per token
(a delta that brings k tokens after a gap adds k samples of gap / k), queue time as the engine
measured it (arrival to first scheduled). Engine-level series (running, waiting, KV usage,
preemptions, prefix cache) are each engine's counters as last reported, with an `engine="i"` label
as vLLM labels them under data parallelism (one series per engine; sum over `engine` for the whole
server).

The `pipeserve_gateway_*` series are the gateway's own state (streams in flight, aborted ids
awaiting the engine, outcomes, requests routed to each engine) that the harness and the tests probe;
`pipeserve_engine{name}` is every counter summed over the engines (plus the detokenizer's),
`pipeserve_engine_stat{engine,name}` each engine's own, `pipeserve_engine_serving` and
`pipeserve_engine_load` each engine's health and routing load, and `pipeserve_topology` the data-
and tensor-parallel sizes.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pipeserve.gateway.router import Router
from pipeserve.lora import LORA_RUNNING
from pipeserve.sampling_params import PREEMPTIONS_BY_PRIORITY

PREFIX = "pipeserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")
HTTP_LIMITS = ("max_connections", "header_timeout", "body_timeout")  # gateway/http_limits.py


def token_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets of token counts)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(float(value))
        exponent += 1


class GatewayView(Protocol):
    """What the collector reads from the gateway at scrape time."""

    @property
    def streams(self) -> Mapping[str, Any]: ...
    @property
    def aborted(self) -> Mapping[str, float]: ...
    @property
    def outcomes(self) -> Mapping[str, int]: ...
    @property
    def detok_stats(self) -> Mapping[str, int]: ...
    @property
    def router(self) -> Router: ...
    @property
    def serving(self) -> bool: ...
    @property
    def zmq_refused(self) -> int: ...


# vLLM's engine-level series: name -> (family, the engine counter it reads, help).
ENGINE_SERIES: dict[str, tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str]] = {
    "num_requests_running": (GaugeMetricFamily, "running", "requests in the running batch"),
    "num_requests_waiting": (GaugeMetricFamily, "waiting", "requests waiting to be scheduled"),
    "num_preemptions": (CounterMetricFamily, "preemptions", "requests preempted by the scheduler"),
    "prefix_cache_queries": (CounterMetricFamily, "prefix_cache_queries",
                             "prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": (CounterMetricFamily, "prefix_cache_hits",
                          "prompt tokens found in the prefix cache"),
    "spec_decode_num_draft_tokens": (CounterMetricFamily, "spec_draft_tokens", "speculative decoding: tokens "
                                     "proposed and verified"),
    "spec_decode_num_accepted_tokens": (CounterMetricFamily, "spec_accepted_tokens", "speculative decoding: "
                                        "proposed tokens the model kept"),
    "spec_decode_num_drafts": (CounterMetricFamily, "spec_verifications", "speculative decoding: "
                               "verifications (a request's proposals in one step); accepted / drafts is the "
                               "mean accepted length"),
    "lora_swaps": (CounterMetricFamily, "lora_swaps", "LoRA adapters loaded into a slot of the device table"),
}


def engine_families(engines: Sequence[Mapping[str, int]]) -> Iterator[Metric]:
    """The vLLM-named engine series from each engine's reported counters (engines[i]: engine i's),
    labelled engine="i"; an engine contributes a series once it reports the counter."""
    for name, (family, key, help) in ENGINE_SERIES.items():
        metric = family(PREFIX + name, help, labels=["engine"])
        for i, stats in enumerate(engines):
            if key in stats:
                metric.add_metric([str(i)], stats[key])
        yield metric
    metric = CounterMetricFamily(PREFIX + "num_preemptions_by_priority",
                                 "requests preempted by the scheduler, by the preempted request's priority",
                                 labels=["engine", "priority"])
    for i, stats in enumerate(engines):
        for key, n in stats.items():
            if key.startswith(PREEMPTIONS_BY_PRIORITY):
                metric.add_metric([str(i), key.removeprefix(PREEMPTIONS_BY_PRIORITY)], n)
    yield metric
    running = GaugeMetricFamily(PREFIX + "lora_running_requests", "running requests per LoRA adapter",
                                labels=["engine", "lora_name"])
    for i, stats in enumerate(engines):
        for key, n in stats.items():
            if key.startswith(LORA_RUNNING):
                running.add_metric([str(i), key.removeprefix(LORA_RUNNING)], n)
    yield running
    usage = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "fraction of the KV cache pages in use "
                              "(1 = full)", labels=["engine"])
    for i, stats in enumerate(engines):
        if stats.get("pages_total"):
            usage.add_metric([str(i)], stats.get("pages_used", 0) / stats["pages_total"])
    yield usage


class _StateCollector:
    """Gateway state and the engines' counters, read at scrape time (nothing on the hot path)."""

    def __init__(self, gateway: GatewayView) -> None:
        self.gateway = gateway

    def collect(self) -> Iterator[Metric]:
        gw = self.gateway
        yield GaugeMetricFamily("pipeserve_gateway_inflight", "streams in flight", value=len(gw.streams))
        yield GaugeMetricFamily(
            "pipeserve_gateway_aborting", "aborted ids awaiting the engine's finish", value=len(gw.aborted)
        )
        yield GaugeMetricFamily("pipeserve_gateway_serving", "1 when health is SERVING",
                                value=float(gw.serving))
        outcomes = CounterMetricFamily("pipeserve_gateway_requests", "requests by outcome",
                                       labels=["outcome"])
        for outcome, count in dict(gw.outcomes).items():
            outcomes.add_metric([outcome], count)
        yield outcomes
        engines = gw.router.engines
        per_engine_stats = [dict(view.stats) for view in engines]
        total: collections.Counter[str] = collections.Counter(dict(gw.detok_stats))
        for stats in per_engine_stats:
            total.update(stats)
        engine = GaugeMetricFamily("pipeserve_engine", "engine counters as last reported, summed over the "
                                   "engines", labels=["name"])
        for name, value in total.items():
            engine.add_metric([name], value)
        yield engine
        per_engine = GaugeMetricFamily("pipeserve_engine_stat", "each engine's counters as last reported",
                                       labels=["engine", "name"])
        live = GaugeMetricFamily("pipeserve_engine_serving", "1 while the engine's heartbeats arrive",
                                 labels=["engine"])
        load = GaugeMetricFamily("pipeserve_engine_load", "the routing load: waiting x 4 + running",
                                 labels=["engine"])
        routed = CounterMetricFamily("pipeserve_gateway_routed_requests", "requests routed to each engine",
                                     labels=["engine"])
        for i, (view, stats) in enumerate(zip(engines, per_engine_stats, strict=True)):
            for name, value in stats.items():
                per_engine.add_metric([str(i), name], value)
            live.add_metric([str(i)], float(view.live))
            load.add_metric([str(i)], view.load())
            routed.add_metric([str(i)], view.routed)
        topology = GaugeMetricFamily("pipeserve_topology", "engines (data parallel) and ranks per engine "
                                     "(tensor parallel)",
                                     labels=["data_parallel_size", "tensor_parallel_size"])
        topology.add_metric([str(len(engines)), str(max(v.tensor_parallel_size for v in engines))], 1)
        refused = CounterMetricFamily(
            "pipeserve_zmq_refused", "ZeroMQ peers refused on the internal tcp:// sockets (no or a wrong "
            "CURVE key), by the process that refused them", labels=["process"])
        refused.add_metric(["gateway"], gw.zmq_refused)
        if "zmq_refused" in gw.detok_stats:
            refused.add_metric(["detokenizer"], gw.detok_stats["zmq_refused"])
        for i, stats in enumerate(per_engine_stats):
            if "zmq_refused" in stats:
                refused.add_metric([f"engine-{i}"], stats["zmq_refused"])
        yield from (per_engine, live, load, routed, topology, refused)
        yield from engine_families(per_engine_stats)


class ServingMetrics:
    """The registry and the per-request observations the gateway makes as deltas arrive."""

    def __init__(self, gateway: GatewayView, clock: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        self.clock = clock
        self.registry.register(_StateCollector(gateway))
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of requests that started",
                                     registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "generated tokens", registry=r)
        self.success = Counter(PREFIX + "request_success", "requests finished by the engine",
                               ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.success.labels(reason)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "admission to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "time between two tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "admission to the last token",
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "engine arrival to first scheduled",
                               buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.http_refused = Counter("pipeserve_gateway_http_refused", "HTTP connections refused or closed "
                                    "by a limit", ["reason"], registry=r)
        for reason in HTTP_LIMITS:
            self.http_refused.labels(reason)
        self.request_prompt: Histogram | None = None  # buckets need the context length: set_context()
        self.request_generation: Histogram | None = None

    def set_context(self, context_length: int) -> None:
        """The token-count histograms, bucketed up to the served context (once, at the first report)."""
        if self.request_prompt is not None:
            return
        buckets = token_buckets(context_length)
        self.request_prompt = Histogram(PREFIX + "request_prompt_tokens", "prompt tokens per finished "
                                        "request", buckets=buckets, registry=self.registry)
        self.request_generation = Histogram(PREFIX + "request_generation_tokens", "generated tokens per "
                                            "finished request", buckets=buckets, registry=self.registry)

    def tokens(self, arrival: float, last: float, count: int, prompt_tokens: int, queue_time: float,
               now: float) -> None:
        """count new tokens of a request admitted at `arrival` whose previous token came at `last`
        (0: these are its first)."""
        if not count:
            return
        self.generation_tokens.inc(count)
        gaps = count
        if not last:
            self.ttft.observe(now - arrival)
            self.queue.observe(max(0.0, queue_time))
            self.prompt_tokens.inc(prompt_tokens)
            gaps, last = count - 1, now
        for _ in range(gaps):
            self.itl.observe((now - last) / gaps)

    def finished(self, arrival: float, reason: str, prompt_tokens: int, generation_tokens: int,
                 now: float) -> None:
        self.success.labels(reason).inc()
        self.e2e.observe(now - arrival)
        if self.request_prompt is not None and self.request_generation is not None:
            self.request_prompt.observe(prompt_tokens)
            self.request_generation.observe(generation_tokens)

    def aborted(self) -> None:
        """A request the client ended (cancel, disconnect, Abort): counted, but kept out of the latency
        and length histograms, which describe requests that ran to their end."""
        self.success.labels("abort").inc()

    def render(self) -> bytes:
        """The exposition text of every series."""
        return generate_latest(self.registry)
