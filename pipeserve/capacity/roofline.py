"""Speed of light for a Llama-family model (dense or mixture of experts) on a GPU: the cost model and
`pipeserve roofline`.

A forward pass reads every matmul weight once (lm_head included, the embedding table not: a lookup
reads one row per token), reads the K/V each query attends to and writes the new tokens' K/V. It
does 2 FLOPs per weight per token (lm_head only for rows that need logits) plus 4 x heads x head_dim
per (query, key) pair per layer for attention. The floor of a step is max(bytes / bandwidth,
GEMM FLOPs / weight-format rate + attention FLOPs / bf16 rate): activations, kernel launches and
imperfect overlap only add to it. Decode is memory-bound until the batch is large; prefill is
compute-bound.

Mixtures of experts: a token's FLOPs count only its top-k experts (the active parameters), and a
step reads only the experts its tokens touch. With uniform routing, n tokens each picking k of E
experts touch E x (1 - (1 - k/E)^n) distinct experts per sparse layer on average: one token reads
k experts, a batch of a few hundred reads them all (`ModelShape.experts_touched`).

Library (pure arithmetic, what the simulator and the benchmarks call):
    shape = ModelShape.preset("llama-2-7b")      # or ModelShape.from_path(dir) / .from_hf_config(dict)
    gpu = GPU.get("H200").with_overrides(bandwidth=4.3e12)
    cost = cost_model(shape, gpu, "int8", "bf16")  # cached per arguments
    cost.decode(batch=32, context=1024).t          # seconds per decode step
    cost.step(decode_contexts=[...], prefill_chunks=[(n_tokens, n_cached), ...]).t  # one merge step

JSON written by `--json PATH`:
    model: the ModelShape fields and `params` (parameters held in memory).
    gpu: name, bandwidth (bytes/s), bf16_flops, int8_ops, fp8_flops (dense, per second; null where
        the part lacks the format), memory (bytes).
    memory_utilization: fraction of GPU memory the engine may fill with weights and KV cache.
    quantize_lm_head: whether lm_head uses the weight dtype (else it stays bf16).
    dtypes[]: one entry per (weight dtype, KV dtype):
        wdtype, kvdtype;
        weight_bytes: all weights held in memory (embedding table included), scales included;
        weight_bytes_read: weight bytes one forward pass reads besides the routed experts (every matmul
            weight incl. lm_head, norms and biases; not the embedding table): all of them for a dense model;
        expert_bytes: bytes of one routed expert summed over the sparse layers (0: dense); a step
            reads experts_touched x expert_bytes on top of weight_bytes_read;
        kv_bytes_per_token: K and V of one token over all layers, scales included;
        kv_capacity_tokens: floor((memory x memory_utilization - weight_bytes) / kv_bytes_per_token),
            0 when the weights do not fit.
    points[]: one entry per (wdtype, kvdtype, batch, context):
        wdtype, kvdtype, batch, context;
        experts_touched (mixtures of experts only): expected distinct experts per sparse layer a
            decode step of `batch` reads;
        decode: one decode step of `batch` requests, each attending over `context` tokens;
        prefill: one step prefilling `batch` prompts of `context` tokens (the TTFT floor when they
            arrive together);
            each of the two: bytes (moved to/from memory), flops, t_mem_ms (bytes / bandwidth),
            t_compute_ms (FLOPs / peak rates), t_ms (the larger: the floor), bound ("memory" or
            "compute");
        ms_per_token: decode.t_ms, the floor on time per output token (TPOT);
        tokens_per_s: batch / decode time, the ceiling on decode throughput;
        prefill_tokens_per_s: batch x context / prefill time;
        requests_fit: kv_capacity_tokens // context, requests of this context that fit in memory;
        fits: batch <= requests_fit.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pipeserve.bench.report import Panel, Series, plot_panels, print_table, write_json
from pipeserve.capacity.gpus import GIB, GPU, GPUS, TB
from pipeserve.config import EngineConfig
from pipeserve.model_config import (
    ARCHITECTURE_BY_MODEL_TYPE,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    unwrap_text_config,
)


@dataclass(frozen=True)
class WeightDtype:
    bytes_per_param: float  # scales included
    compute: str  # tensor-core format the GEMMs run in: "bf16", "int8" or "fp8"


WEIGHT_DTYPES: dict[str, WeightDtype] = {
    "bf16": WeightDtype(2.0, "bf16"),
    "fp16": WeightDtype(2.0, "bf16"),
    # W8A8 with one scale per output channel: 2 bytes per row of >= 4096 weights, ignored.
    "int8": WeightDtype(1.0, "int8"),
    "fp8": WeightDtype(1.0, "fp8"),
    # W4A16, symmetric, one fp16 scale per group of 128 weights (asymmetric adds a 4-bit zero per group).
    "int4": WeightDtype(0.5 + 2 / 128, "bf16"),
}

# Bytes per cached K or V element. int8: PPL.LLM's symmetric int8 with one fp16 scale per 8 channels.
KV_DTYPES: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "int8": 1.0 + 2 / 8, "fp8": 1.0}


@dataclass(frozen=True)
class ModelShape:
    """What the cost of a Llama/Mistral/Qwen2 model, or of a Mixtral / Qwen-MoE mixture of experts,
    depends on. A mixture's sparse layers (`moe_layers` of them) hold `num_experts` experts of
    `moe_intermediate_size` (plus a router and, Qwen2-MoE, a shared expert with its gate) instead of
    the dense MLP of `intermediate_size` the other layers keep."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    layer_bias_params: int = 0  # bias parameters of one layer (Qwen2: q, k, v)
    sliding_window: int | None = None
    num_experts: int = 0  # routed experts per sparse layer; 0: a dense model
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: int = 0  # sparse layers

    @property
    def layer_linear_params(self) -> int:
        """q, k, v, o, gate, up and down weights of one dense layer."""
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size

    @property
    def attention_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        return h * d * 2 * (self.num_heads + self.num_kv_heads)

    @property
    def expert_params(self) -> int:
        """gate, up and down weights of one routed expert in one layer."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def sparse_layer_dense_params(self) -> int:
        """What a sparse layer reads whichever experts it routes to: attention, router, shared expert."""
        h = self.hidden_size
        shared_inter = self.shared_expert_intermediate_size
        shared = 3 * h * shared_inter + (h if shared_inter else 0)  # the shared expert and its gate
        return self.attention_params + h * self.num_experts + shared

    @property
    def dense_linear_params(self) -> int:
        """Linear weights but the routed experts' (all of them for a dense model)."""
        dense_layers = self.num_layers - self.moe_layers
        return dense_layers * self.layer_linear_params + self.moe_layers * self.sparse_layer_dense_params

    @property
    def linear_params(self) -> int:
        """Every linear weight held in memory, every routed expert included (the total parameters)."""
        return self.dense_linear_params + self.moe_layers * self.num_experts * self.expert_params

    @property
    def active_linear_params(self) -> int:
        """Linear weights one token runs through: the routed experts' top-k only."""
        return self.dense_linear_params + self.moe_layers * self.experts_per_tok * self.expert_params

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts per sparse layer `tokens` tokens route to, each picking
        experts_per_tok of num_experts uniformly: E x (1 - (1 - k/E)^tokens)."""
        if not self.num_experts:
            return 0.0
        e, k = self.num_experts, self.experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** tokens)

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def small_params(self) -> int:
        """Norm weights and biases, always kept in bf16."""
        return self.num_layers * (2 * self.hidden_size + self.layer_bias_params) + self.hidden_size

    @property
    def params(self) -> int:
        """Parameters held in memory; a tied lm_head shares the embedding table."""
        embeddings = self.lm_head_params * (1 if self.tie_word_embeddings else 2)
        return self.linear_params + self.small_params + embeddings

    @property
    def active_params(self) -> int:
        """Parameters one token runs through (params for a dense model): its top-k experts only, the
        lm_head but not the embedding table's other rows."""
        return self.params - (self.linear_params - self.active_linear_params)

    @property
    def kv_elems_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @staticmethod
    def from_hf_config(cfg: dict[str, Any], name: str = "") -> ModelShape:
        """From a Hugging Face config.json dict, read by the engine's own reader
        (pipeserve/model_config.py). An architecture the engine does not serve is costed as the Llama
        it looks like (same fields, no biases beyond what the config states)."""
        if cfg.get("n_routed_experts"):
            raise ValueError(f"n_routed_experts={cfg['n_routed_experts']}: DeepSeek-style MoE is not covered")
        cfg = unwrap_text_config(cfg)
        known = cfg.get("architectures") or [ARCHITECTURE_BY_MODEL_TYPE.get(cfg.get("model_type", ""), "")]
        if not any(a in SUPPORTED_ARCHITECTURES for a in known):
            cfg = cfg | {"architectures": ["MixtralForCausalLM" if cfg.get("num_local_experts")
                                           else "LlamaForCausalLM"]}
        mc = ModelConfig.from_dict(cfg)
        h, d = mc.hidden_size, mc.head_dim
        bias = d * (mc.num_heads + 2 * mc.num_kv_heads) if mc.attention_bias else 0
        if mc.attention_bias and mc.architecture in ("LlamaForCausalLM", "MistralForCausalLM"):
            bias += h  # Llama's attention_bias covers o_proj too
        if cfg.get("mlp_bias"):
            bias += 2 * mc.intermediate_size + h
        moe = {}
        if mc.is_moe:
            moe = {
                "num_experts": mc.num_experts,
                "experts_per_tok": mc.num_experts_per_tok,
                "moe_intermediate_size": mc.moe_intermediate_size,
                "shared_expert_intermediate_size": mc.shared_expert_intermediate_size,
                "moe_layers": sum(mc.moe_layers),
            }
        return ModelShape(
            name=name or cfg.get("_name_or_path") or cfg.get("model_type", "llama"),
            hidden_size=h,
            intermediate_size=mc.intermediate_size,
            num_layers=mc.num_layers,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=d,
            vocab_size=mc.vocab_size,
            max_position_embeddings=mc.max_position_embeddings,
            tie_word_embeddings=bool(mc.tie_word_embeddings),
            layer_bias_params=bias,
            sliding_window=next((w for w in mc.layer_sliding_windows if w is not None), None),
            **moe,
        )

    @staticmethod
    def from_path(path: str | os.PathLike[str]) -> ModelShape:
        """From a checkpoint directory or a config.json file."""
        path = Path(path)
        directory, config = (path, path / "config.json") if path.is_dir() else (path.parent, path)
        return ModelShape.from_hf_config(json.loads(config.read_text()), name=directory.name)

    @staticmethod
    def preset(name: str) -> ModelShape:
        try:
            return PRESETS[name.lower()]
        except KeyError:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None

    @staticmethod
    def resolve(spec: str) -> ModelShape:
        """A preset name, else a checkpoint directory or config.json path."""
        if spec.lower() in PRESETS:
            return ModelShape.preset(spec)
        if not Path(spec).exists():
            raise ValueError(f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor a path")
        return ModelShape.from_path(spec)


# The architectures' own config.json figures (meta-llama, Qwen, mistralai on the HF hub).
PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("llama-2-7b", 4096, 11008, 32, 32, 32, 128, 32000, 4096),
        ModelShape("llama-3-8b", 4096, 14336, 32, 32, 8, 128, 128256, 8192),
        # Qwen2-7B-Instruct: q, k and v projections carry biases.
        ModelShape("qwen2-7b", 3584, 18944, 28, 28, 4, 128, 152064, 32768, layer_bias_params=128 * (28 + 8)),
        # Mistral-7B-v0.1: 4096-token sliding window.
        ModelShape("mistral-7b", 4096, 14336, 32, 32, 8, 128, 32000, 32768, sliding_window=4096),
        ModelShape("llama-2-70b", 8192, 28672, 80, 64, 8, 128, 32000, 4096),
        ModelShape("llama-3-70b", 8192, 28672, 80, 64, 8, 128, 128256, 8192),
        # Mixtral-8x7B-v0.1: 8 experts of 14336, top-2, in all 32 layers.
        ModelShape("mixtral-8x7b", 4096, 14336, 32, 32, 8, 128, 32000, 32768, num_experts=8,
                   experts_per_tok=2, moe_intermediate_size=14336, moe_layers=32),
        # Qwen3-30B-A3B: 128 experts of 768, top-8, in all 48 layers; q/k norms, no biases.
        ModelShape("qwen3-30b-a3b", 2048, 6144, 48, 32, 4, 128, 151936, 40960, num_experts=128,
                   experts_per_tok=8, moe_intermediate_size=768, moe_layers=48),
    )
}


@dataclass(frozen=True, slots=True)
class StepCost:
    """Floor of one forward pass. Times in seconds."""

    bytes: float
    flops: float
    t_mem: float
    t_compute: float
    t: float  # max(t_mem, t_compute)

    @property
    def bound(self) -> str:
        return "memory" if self.t_mem >= self.t_compute else "compute"

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "flops": self.flops,
            "t_mem_ms": self.t_mem * 1e3,
            "t_compute_ms": self.t_compute * 1e3,
            "t_ms": self.t * 1e3,
            "bound": self.bound,
        }


ZERO_COST = StepCost(0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Per-(model, GPU, dtypes) constants; the step methods are a handful of float operations."""

    bandwidth: float
    gemm_rate: float  # linear layers but lm_head
    lm_head_rate: float
    attn_rate: float
    memory: float
    weight_bytes: float
    weight_bytes_read: float
    kv_bytes_per_token: float
    gemm_flops_per_token: float  # every linear layer but lm_head
    lm_head_flops: float  # per row of logits
    attn_flops_per_pair: float  # per (query, key) pair, all layers
    window: int | None
    expert_bytes: float = 0.0  # one routed expert over all sparse layers (0: dense)
    num_experts: int = 0
    experts_per_tok: int = 0

    def experts_touched(self, tokens: int) -> float:
        """ModelShape.experts_touched: expected distinct experts per sparse layer."""
        if not self.num_experts:
            return 0.0
        e, k = self.num_experts, self.experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** tokens)

    def weights_read(self, tokens: int) -> float:
        """Weight bytes a step of `tokens` tokens reads: the dense part and the experts it touches."""
        return self.weight_bytes_read + self.experts_touched(tokens) * self.expert_bytes

    def kv_capacity_tokens(self, memory_utilization: float = EngineConfig.gpu_memory_utilization) -> int:
        free = self.memory * memory_utilization - self.weight_bytes
        return max(0, int(free // self.kv_bytes_per_token))

    def _span(self, seq_len: int, n: int) -> int:
        """Keys a chunk of n queries ending at seq_len attends to."""
        return seq_len if self.window is None else min(seq_len, self.window + n - 1)

    def _pairs(self, cached: int, n: int) -> int:
        """(query, key) pairs of a causal chunk: sum of min(p, window) for p in cached+1 .. cached+n."""
        lo, hi = cached + 1, cached + n
        w = self.window
        if w is None or hi <= w:
            return (lo + hi) * n // 2
        if lo > w:
            return w * n
        return (lo + w) * (w - lo + 1) // 2 + w * (hi - w)

    def _cost(self, tokens: int, logit_rows: int, kv_read_tokens: int, pairs: int) -> StepCost:
        if tokens == 0:
            return ZERO_COST
        nbytes = self.weights_read(tokens) + (kv_read_tokens + tokens) * self.kv_bytes_per_token
        gemm = tokens * self.gemm_flops_per_token
        head = logit_rows * self.lm_head_flops
        attn = pairs * self.attn_flops_per_pair
        t_mem = nbytes / self.bandwidth
        t_compute = gemm / self.gemm_rate + head / self.lm_head_rate + attn / self.attn_rate
        return StepCost(nbytes, gemm + head + attn, t_mem, t_compute, max(t_mem, t_compute))

    def decode(self, batch: int, context: int) -> StepCost:
        """One decode step of `batch` requests whose KV length (new token included) is `context`."""
        span = self._span(context, 1)
        return self._cost(batch, batch, batch * span, batch * span)

    def prefill(self, n_tokens: int, cached: int = 0, batch: int = 1) -> StepCost:
        """Prefill of `batch` chunks of `n_tokens` after `cached` tokens already in the cache."""
        span = self._span(cached + n_tokens, n_tokens)
        return self._cost(batch * n_tokens, batch, batch * span, batch * self._pairs(cached, n_tokens))

    def step(
        self, decode_contexts: Sequence[int] = (), prefill_chunks: Sequence[tuple[int, int]] = ()
    ) -> StepCost:
        """One merge step: decode rows with these KV lengths plus prefill chunks (n_tokens, n_cached),
        each chunk producing one row of logits."""
        if self.window is None:
            kv = sum(decode_contexts)
        else:
            kv = sum(min(c, self.window) for c in decode_contexts)
        pairs = kv
        tokens = len(decode_contexts)
        for n, cached in prefill_chunks:
            tokens += n
            kv += self._span(cached + n, n)
            pairs += self._pairs(cached, n)
        return self._cost(tokens, len(decode_contexts) + len(prefill_chunks), kv, pairs)


@lru_cache(maxsize=256)
def cost_model(
    shape: ModelShape, gpu: GPU, wdtype: str = "bf16", kvdtype: str = "bf16", quantize_lm_head: bool = True
) -> CostModel:
    if wdtype not in WEIGHT_DTYPES:
        raise ValueError(f"unknown weight dtype {wdtype!r}; known: {', '.join(WEIGHT_DTYPES)}")
    if kvdtype not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {kvdtype!r}; known: {', '.join(KV_DTYPES)}")
    w = WEIGHT_DTYPES[wdtype]
    head_bpp = w.bytes_per_param if quantize_lm_head else 2.0
    read = (
        shape.dense_linear_params * w.bytes_per_param
        + shape.lm_head_params * head_bpp
        + shape.small_params * 2.0
    )
    expert_bytes = shape.moe_layers * shape.expert_params * w.bytes_per_param
    # An untied embedding table is a separate bf16 matrix; a tied one is lm_head itself.
    resident = (
        read
        + shape.num_experts * expert_bytes
        + (0 if shape.tie_word_embeddings else shape.lm_head_params * 2.0)
    )
    return CostModel(
        bandwidth=gpu.bandwidth,
        gemm_rate=gpu.gemm_rate(w.compute),
        lm_head_rate=gpu.gemm_rate(w.compute if quantize_lm_head else "bf16"),
        attn_rate=gpu.bf16_flops,
        memory=gpu.memory,
        weight_bytes=resident,
        weight_bytes_read=read,
        kv_bytes_per_token=shape.kv_elems_per_token * KV_DTYPES[kvdtype],
        gemm_flops_per_token=2.0 * shape.active_linear_params,
        lm_head_flops=2.0 * shape.lm_head_params,
        attn_flops_per_pair=4.0 * shape.num_layers * shape.num_heads * shape.head_dim,
        window=shape.sliding_window,
        expert_bytes=expert_bytes,
        num_experts=shape.num_experts,
        experts_per_tok=shape.experts_per_tok,
    )


def decode_step_cost(
    shape: ModelShape, gpu: GPU, batch: int, context: int, wdtype: str = "bf16", kvdtype: str = "bf16"
) -> StepCost:
    return cost_model(shape, gpu, wdtype, kvdtype).decode(batch, context)


def prefill_cost(
    shape: ModelShape,
    gpu: GPU,
    n_tokens: int,
    cached: int = 0,
    batch: int = 1,
    wdtype: str = "bf16",
    kvdtype: str = "bf16",
) -> StepCost:
    return cost_model(shape, gpu, wdtype, kvdtype).prefill(n_tokens, cached, batch)


def step_time(
    shape: ModelShape,
    gpu: GPU,
    decode_contexts: Sequence[int] = (),
    prefill_chunks: Sequence[tuple[int, int]] = (),
    wdtype: str = "bf16",
    kvdtype: str = "bf16",
) -> float:
    """Floor in seconds of one merge step (see CostModel.step)."""
    return cost_model(shape, gpu, wdtype, kvdtype).step(decode_contexts, prefill_chunks).t


def roofline(
    shape: ModelShape,
    gpu: GPU,
    wdtypes: Sequence[str] = ("bf16",),
    kvdtypes: Sequence[str] = ("bf16",),
    batches: Sequence[int] = (1,),
    contexts: Sequence[int] = (1024,),
    memory_utilization: float = EngineConfig.gpu_memory_utilization,
    quantize_lm_head: bool = True,
) -> dict[str, Any]:
    """Every point of the grid, as the JSON the module docstring describes."""
    dtypes, points = [], []
    for wdtype in wdtypes:
        for kvdtype in kvdtypes:
            cost = cost_model(shape, gpu, wdtype, kvdtype, quantize_lm_head)
            capacity = cost.kv_capacity_tokens(memory_utilization)
            dtypes.append(
                {
                    "wdtype": wdtype,
                    "kvdtype": kvdtype,
                    "weight_bytes": cost.weight_bytes,
                    "weight_bytes_read": cost.weight_bytes_read,
                    "expert_bytes": cost.expert_bytes,
                    "kv_bytes_per_token": cost.kv_bytes_per_token,
                    "kv_capacity_tokens": capacity,
                }
            )
            for context in contexts:
                for batch in batches:
                    decode = cost.decode(batch, context)
                    prefill = cost.prefill(context, 0, batch)
                    requests_fit = capacity // context
                    moe = {"experts_touched": cost.experts_touched(batch)} if shape.num_experts else {}
                    points.append(
                        moe | {
                            "wdtype": wdtype,
                            "kvdtype": kvdtype,
                            "batch": batch,
                            "context": context,
                            "decode": decode.to_json(),
                            "prefill": prefill.to_json(),
                            "ms_per_token": decode.t * 1e3,
                            "tokens_per_s": batch / decode.t,
                            "prefill_tokens_per_s": batch * context / prefill.t,
                            "requests_fit": requests_fit,
                            "fits": batch <= requests_fit,
                        }
                    )
    return {
        "model": {**asdict(shape), "params": shape.params, "active_params": shape.active_params},
        "gpu": asdict(gpu),
        "memory_utilization": memory_utilization,
        "quantize_lm_head": quantize_lm_head,
        "dtypes": dtypes,
        "points": points,
    }


def plot(result: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Decode floor (ms/token) and throughput ceiling (tokens/s) vs batch size, one colour per dtype
    pair and one line style per context. Points whose KV cache does not fit in memory are left out."""
    latency = Panel("floor ms / token", xlabel="batch size", logx=True, title="decode latency floor")
    throughput = Panel(
        "max tokens / s", xlabel="batch size", logx=True, logy=True, title="decode throughput ceiling"
    )
    pairs = [(d["wdtype"], d["kvdtype"]) for d in result["dtypes"]]
    contexts = sorted({p["context"] for p in result["points"]})
    styles = ["-", "--", ":", "-."]
    for i, (wdtype, kvdtype) in enumerate(pairs):
        for j, context in enumerate(contexts):
            pts = [
                p
                for p in result["points"]
                if (p["wdtype"], p["kvdtype"], p["context"]) == (wdtype, kvdtype, context) and p["fits"]
            ]
            if not pts:
                continue
            label = f"w {wdtype} / kv {kvdtype}" + (f", ctx {context}" if len(contexts) > 1 else "")
            style = {"color": f"C{i % 10}", "linestyle": styles[j % len(styles)]}
            xs = [p["batch"] for p in pts]
            latency.series.append(Series(label, xs, [p["ms_per_token"] for p in pts], **style))
            throughput.series.append(Series(label, xs, [p["tokens_per_s"] for p in pts], **style))
    ctx = "" if len(contexts) > 1 else f", context {contexts[0]}"
    title = (
        f"{result['model']['name']} on {result['gpu']['name']}{ctx} (batches whose KV does not fit: left out)"
    )
    return plot_panels(path, [latency, throughput], title=title)


STEP_COLUMNS = ["GB", "TFLOP", "mem ms", "comp ms", "bound"]


def _step_cells(step: dict[str, Any]) -> list[Any]:
    return [step["bytes"] / 1e9, step["flops"] / 1e12, step["t_mem_ms"], step["t_compute_ms"], step["bound"]]


def print_result(result: dict[str, Any]) -> None:
    gpu = result["gpu"]
    model = result["model"]
    if model["num_experts"]:
        print(f"{model['name']}: {model['params'] / 1e9:.4g} B parameters, "
              f"{model['active_params'] / 1e9:.4g} B "
              f"active per token ({model['experts_per_tok']} of {model['num_experts']} experts in "
              f"{model['moe_layers']} sparse layers)")
    print_table(
        f"{result['model']['name']} on {gpu['name']}: {gpu['bandwidth'] / TB:.3g} TB/s, "
        f"{gpu['bf16_flops'] / TB:.4g} bf16 TFLOP/s, {gpu['memory'] / GIB:.4g} GiB",
        ["weights", "KV", "weights GB", "read GB/step", "GB/expert", "KV KiB/token", "KV capacity tokens"],
        [
            (d["wdtype"], d["kvdtype"], d["weight_bytes"] / 1e9, d["weight_bytes_read"] / 1e9,
             d["expert_bytes"] / 1e9, d["kv_bytes_per_token"] / 1024, d["kv_capacity_tokens"])
            for d in result["dtypes"]
        ],
    )  # fmt: skip
    points = result["points"]
    key = ["weights", "KV", "batch", "context"]
    print_table(
        "decode step: batch requests, each attending over context tokens"
        + (" (experts: expected distinct experts read per sparse layer)" if model["num_experts"] else ""),
        [*key, *(["experts"] if model["num_experts"] else []), *STEP_COLUMNS, "ms/token", "tokens/s",
         "requests fit"],
        [
            [p["wdtype"], p["kvdtype"], p["batch"], p["context"],
             *([p["experts_touched"]] if model["num_experts"] else []), *_step_cells(p["decode"]),
             p["ms_per_token"], p["tokens_per_s"], p["requests_fit"]]
            for p in points
        ],
    )  # fmt: skip
    print_table(
        "prefill: batch prompts of context tokens in one step",
        [*key, *STEP_COLUMNS, "ms", "tokens/s"],
        [
            [p["wdtype"], p["kvdtype"], p["batch"], p["context"], *_step_cells(p["prefill"]),
             p["prefill"]["t_ms"], p["prefill_tokens_per_s"]]
            for p in points
        ],
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="llama-2-7b",
        help=f"preset ({', '.join(PRESETS)}) or HF checkpoint dir / config.json",
    )
    parser.add_argument("--gpu", default="H200", help=f"datasheet entry: {', '.join(GPUS)}")
    parser.add_argument("--bandwidth", type=float, help="override memory bandwidth, TB/s (a measured figure)")
    parser.add_argument(
        "--flops", type=float, help="override dense bf16 TFLOP/s; int8/fp8 rates scale by the same ratio"
    )
    parser.add_argument("--memory-gib", type=float, help="override GPU memory, GiB")
    parser.add_argument("--wdtype", nargs="+", default=["bf16"], choices=list(WEIGHT_DTYPES),
                        help="weight dtypes to tabulate")
    parser.add_argument("--kv-dtype", nargs="+", default=["bf16"], choices=list(KV_DTYPES),
                        help="KV cache dtypes to tabulate")
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                        help="decode batch sizes")
    parser.add_argument(
        "--context",
        nargs="+",
        type=int,
        default=[1024],
        help="KV length of each decoding request, and prompt length for prefill",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization,
                        help="fraction of GPU memory for weights and KV cache")
    parser.add_argument("--bf16-lm-head", action="store_true", help="keep lm_head in bf16 (vLLM's default)")
    parser.add_argument("--json", metavar="PATH", help="write the full results as JSON")
    parser.add_argument("--out", metavar="DIR", help="write roofline.png into DIR")


def main(args: argparse.Namespace) -> int:
    if min(args.batch) < 1 or min(args.context) < 1:
        raise SystemExit("pipeserve roofline: --batch and --context values must be >= 1")
    try:
        shape = ModelShape.resolve(args.model)
        gpu = GPU.get(args.gpu)
    except ValueError as e:
        raise SystemExit(f"pipeserve roofline: {e}") from None
    gpu = gpu.with_overrides(
        bandwidth=None if args.bandwidth is None else args.bandwidth * TB,
        flops=None if args.flops is None else args.flops * TB,
        memory=None if args.memory_gib is None else args.memory_gib * GIB,
    )
    result = roofline(
        shape,
        gpu,
        args.wdtype,
        args.kv_dtype,
        args.batch,
        args.context,
        args.gpu_memory_utilization,
        quantize_lm_head=not args.bf16_lm_head,
    )
    print_result(result)
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    if args.out:
        print(f"wrote {plot(result, Path(args.out) / 'roofline.png')}")
    return 0
