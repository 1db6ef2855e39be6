"""The native step: a step of a dense fp32 or bf16 Llama-family model on the CPU as one native call.

backend/csrc/decode_step.cpp runs the whole forward pass of a batch of rows (embedding, every
layer, the final norm, and the logits where the LM head is packed) over the model's own packed
weights and the pool's cache. Each row is a query at its own position attending to its own first
seq_len keys once every row's K/V of the layer is stored: a decode row, a verification row, or a row
of a prefill chunk. A compiled per-op step still pays, per op, the dispatcher and a Python call into
each native kernel, plus the compiled wrapper and its guards: at batch 1 on a small model that was a
quarter of the step (docs/engine.md). Here one ctypes call replaces them.

It covers what the per-op forward pass computes for the dense models (Llama, Mistral, Qwen2): fused
qkv with its bias, rotate-half rotary embedding over the model's table (any scaling), sliding
windows per layer, grouped-query attention and the SiLU-gated MLP, with fp32 or bf16 weights (the
products accumulate in fp32; activations stay fp32 between them) and an fp32 or bf16 cache.
Anything else (quantized weights or cache, mixtures of experts and their q/k norms, fp16, hosts
without a C++ compiler) takes Inductor's compiled step: `unsupported` says why, from what
model/llama.py declares the native step mirrors (NATIVE_STEP).

Each row runs as itself (nothing is padded, nothing to compile beyond the kernels' C++), so merged
steps (decode rows beside a prefill chunk of up to NATIVE_MERGED_ROWS rows) run native too. Steps of
as many rows as the measured table says oneDNN's GEMM wins at for most of the model's weight
(backend/cpu_gemm.py, backend/cpu_linear.py's gemm_rows) run per op instead, where the layers take it.

Linear layers that backend/cpu_linear.py packed are used as they are; smaller ones (left unpacked
there, where a call of their own would cost more than packing gains) are packed here, once.

LoRA adapters (engine/lora): where the model's linear layers are wrapped by LoRALinear, the step
reads the base layers' weights and the slot table's own tensors (the addresses of its A and B per
layer and kind, and each slot's kind mask): a swap between steps writes them in place, and the next
step reads the new adapter; nothing is copied per step. Each step passes every row's adapter slot
(the manager's request -> slot array gathered by the rows' requests, one int32 each).
"""

from __future__ import annotations

import ctypes
import inspect
import time
from typing import cast

import numpy as np
import torch
from torch import nn

from pipeserve.engine.backend import native
from pipeserve.engine.backend.cpu_linear import CpuLinear, gemm_rows
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.lora.layer import LoRALinear
from pipeserve.engine.lora.layout import KINDS
from pipeserve.engine.lora.manager import LoRAManager
from pipeserve.engine.model.llama import MLP, NATIVE_STEP, DecoderLayer, LlamaForCausalLM

from .base import NATIVE
from .buffers import StepBuffers
from .flat import FlatBatch
from .padded import select_rows

CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # decode_step.cpp's kCacheDtype codes
# One layer's entries in the table the C++ step reads, in decode_step.cpp's LayerField order.
LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down", "k_cache", "v_cache",
                "window", *(f"lora_{kind}_{f}" for kind in KINDS for f in ("a", "b")))
# The model's sizes, in decode_step.cpp's Dim order.
DIMS = ("hidden", "q_heads", "kv_heads", "head_dim", "inter", "layers", "rot_dim", "page_size",
        "weight_dtype", "cache_dtype", "lora_rank", "lora_slots")
# Rows a native step takes at least, so that merged steps (decode rows beside a short prompt or a
# chunk of one) run native too; a longer chunk runs eager, where prefill attention reads each page
# once per chunk instead of once per row (docs/engine.md has the measurements).
NATIVE_MERGED_ROWS = 64
TIED_HEAD_COPY = 1 / 8  # most extra memory a packed copy of a tied head may add, of the weights
_LOGITS = inspect.unwrap(LlamaForCausalLM.compute_logits)  # the caller holds inference mode


def _layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    return cast(list[DecoderLayer], list(model.layers))


def _base(m: nn.Module) -> nn.Module:
    """A linear layer without its LoRA wrapper."""
    return m.base if isinstance(m, LoRALinear) else m


def _linears(model: LlamaForCausalLM) -> list[nn.Module]:
    """The dense layers' linear layers (their base layers, where LoRA wraps them)."""
    return [_base(m) for layer in _layers(model) if isinstance(layer.mlp, MLP)
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                      layer.mlp.down_proj)]


def _adapted(model: LlamaForCausalLM) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def lora_manager(model: LlamaForCausalLM) -> LoRAManager | None:
    """The adapters' manager, where the model's linear layers apply LoRA adapters."""
    adapted = _adapted(model)
    return adapted[0].context.manager if adapted else None


def unsupported(model: LlamaForCausalLM, pool: KVPool) -> str | None:
    """Why the native step cannot run this model over this pool; None when it can."""
    if not model.backend.native_step or not native.available():
        return "the native kernels are not built for this backend here"
    if pool.kv is None or pool.kv.dtype not in CACHE_DTYPES or pool.kv_cache_dtype != "auto":
        return "the KV cache is neither fp32 nor bf16"
    dtypes = {p.dtype for p in (*model.parameters(), *_packed(model)) if p.is_floating_point()}
    if len(dtypes) != 1 or dtypes.pop() not in native.PACKED_DTYPES:
        return "the weights are not all fp32 or all bf16"
    if any(p.device.type != "cpu" for p in model.parameters()):
        return "the weights are not on the CPU"
    cfg = model.config
    refusal = NATIVE_STEP.refusal(cfg)  # a feature of the model the step does not mirror
    if refusal is not None:
        return refusal
    if any(type(layer.mlp) is not MLP or layer.mlp.act_fn is not model.backend.silu_and_mul
           for layer in _layers(model)):
        return "a layer's MLP is not the dense SiLU-gated one (quantized activations)"
    if any(type(m) not in (nn.Linear, CpuLinear) for m in _linears(model)):
        return "a linear layer is quantized or sharded"
    if model.lm_head is not None and type(model.lm_head) not in (nn.Linear, CpuLinear):
        return "the LM head is quantized or sharded"
    weight_dtype = model.embed_tokens.weight.dtype
    if any(t.dtype != weight_dtype or t.device.type != "cpu" or not t.is_contiguous()
           for m in _adapted(model) for t in (m.a, m.b)):
        return "the LoRA slot table is not contiguous CPU memory of the weights' dtype"
    group = cfg.num_heads // cfg.num_kv_heads
    if cfg.head_dim % 2 or model.cos_sin.shape[-1] > cfg.head_dim or group > native.MAX_GROUP:
        return "the attention's shape is outside the native kernels"
    return None


def _packed(model: LlamaForCausalLM) -> list[torch.Tensor]:
    """The packed weights of the model's CpuLinears (buffers, not parameters)."""
    return [m.packed for m in model.modules() if isinstance(m, CpuLinear)]


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    """An fp32 view or copy, for the step's norms, biases and rotary table."""
    return None if t is None else t.detach().float().contiguous()


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class NativeStep:
    """Logits of a decode batch from the model's weights and the pool's cache, in one native call.
    Holds the addresses of both: the model's tensors and the pool must outlive it, unmoved."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, max_rows: int) -> None:
        reason = unsupported(model, pool)
        assert reason is None, reason
        cfg = model.config
        self.model = model
        self._packed: list[torch.Tensor] = []  # packed or converted here: kept alive with the step
        self.dtype = model.embed_tokens.weight.dtype
        self.lora = lora_manager(model)
        caches = pool.layer_views()
        rows = []
        for layer, cache in zip(_layers(model), caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            assert isinstance(mlp, MLP)
            # The slot table's tensors themselves (the LoRALinear's buffers): swaps write them in place.
            lora: dict[str, torch.Tensor | None] = {}
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if isinstance(m, LoRALinear):
                    lora |= {f"lora_{m.kind}_a": m.a, f"lora_{m.kind}_b": m.b}
            entries = {
                "input_norm": self._keep(_f32(layer.input_layernorm.weight)),
                "qkv": self._panels(attn.qkv_proj),
                "qkv_bias": self._keep(_f32(cast(torch.Tensor | None, _base(attn.qkv_proj).bias))),
                "o": self._panels(attn.o_proj),
                "post_norm": self._keep(_f32(layer.post_attention_layernorm.weight)),
                "gate_up": self._panels(mlp.gate_up_proj),
                "down": self._panels(mlp.down_proj),
                "k_cache": cache.k,
                "v_cache": cache.v,
                **lora,
            }
            window = attn.sliding_window or 0
            rows.append([window if name == "window" else _address(entries.get(name))
                         for name in LAYER_FIELDS])
        self.layers = torch.tensor(rows, dtype=torch.int64)
        assert pool.kv is not None
        sizes = {"hidden": cfg.hidden_size, "q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
                 "head_dim": cfg.head_dim, "inter": cfg.intermediate_size, "layers": cfg.num_layers,
                 "rot_dim": model.cos_sin.shape[-1], "page_size": pool.page_size,
                 "weight_dtype": int(self.dtype == torch.bfloat16),
                 "cache_dtype": CACHE_DTYPES[pool.kv.dtype],
                 "lora_rank": 0 if self.lora is None else self.lora.max_rank,
                 "lora_slots": 0 if self.lora is None else self.lora.table.num_slots}
        self.dims = torch.tensor([sizes[name] for name in DIMS], dtype=torch.int64)
        self.hidden = torch.empty(max_rows, cfg.hidden_size)  # the final norm's output
        self.seconds = 0.0  # spent inside the native call (a profiler sees no operator there)
        # The head's product runs in the step too, into this persistent buffer (valid until the next
        # step), where it is packed: an untied head that use_cpu_linears packed, or a tied one (the
        # embedding) packed here as a copy when that costs little memory. Otherwise compute_logits
        # runs after the step.
        head = self._head_panels(model)
        self.logits = None if head is None else torch.empty(max_rows, cfg.vocab_size)
        self.lora_rows = np.empty(max_rows, np.int32)  # each row's adapter slot, refilled every step
        kinds = None if self.lora is None else self.lora.table.kind_bits
        self._lora_kinds = ctypes.c_void_p(_address(kinds))  # each slot's kinds, rewritten in place on swaps
        # Fixed for the step's life: converted to ctypes once, not per call.
        self._fixed = (
            *(ctypes.c_void_p(_address(t)) for t in (
                self.dims, self.layers, model.embed_tokens.weight, self._keep(_f32(model.norm.weight)),
                self._keep(_f32(model.cos_sin)))),
            ctypes.c_float(cfg.rms_norm_eps), ctypes.c_float(cfg.head_dim**-0.5),
            ctypes.c_void_p(_address(head)), cfg.vocab_size,
            ctypes.c_void_p(self.hidden.data_ptr()), ctypes.c_void_p(_address(self.logits)))

    def _keep(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is not None:
            self._packed.append(t)
        return t

    def _head_panels(self, model: LlamaForCausalLM) -> torch.Tensor | None:
        """The LM head packed, or None (its product stays with torch). A tied head is copied packed
        when the copy adds at most TIED_HEAD_COPY of the model's weight bytes: the embedding is cold
        in the caches once the layers' weights have streamed past, and MKL reads it as it lies about
        half as fast as the packed product does (docs/engine.md)."""
        if isinstance(model.lm_head, CpuLinear):
            return model.lm_head.packed
        if model.lm_head is not None:
            return None
        embed = model.embed_tokens.weight
        total = sum(t.numel() for t in (*model.parameters(), *model.buffers()))  # packed weights are buffers
        if embed.numel() > TIED_HEAD_COPY * total:
            return None
        packed = native.pack_weight(embed)
        self._packed.append(packed)
        return packed

    def _panels(self, linear: nn.Module) -> torch.Tensor:
        """The layer's weight in the packed layout: CpuLinear's own, or packed here."""
        linear = _base(linear)
        if isinstance(linear, CpuLinear):
            return linear.packed
        assert isinstance(linear, nn.Linear)
        packed = native.pack_weight(linear.weight)
        self._packed.append(packed)
        return packed

    def __call__(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                 block_tables: np.ndarray, seq_lens: np.ndarray,
                 row_requests: np.ndarray | None = None) -> torch.Tensor:
        """Logits [n, V] of n rows, from host arrays (on the CPU the step reads them where they
        lie: nothing is staged): ids, positions and slots, block tables [n, W] and lengths;
        row_requests: each row's request slot, whose adapter the row applies (with LoRA)."""
        lib = native._lib
        assert lib is not None
        ids, pos, slots = (np.ascontiguousarray(a, dtype=np.int64)
                           for a in (input_ids, positions, slot_mapping))
        tables, lens = (np.ascontiguousarray(a, dtype=np.int32) for a in (block_tables, seq_lens))
        n = ids.shape[0]
        lora_rows = None
        if self.lora is not None and row_requests is not None:
            rows = self.lora_rows[:n]
            rows[:] = self.lora.request_slots[row_requests]
            if (rows >= 0).any():
                lora_rows = rows.ctypes.data
        dims, layers, embed, norm, rope, eps, scale, head, vocab, hidden, logits = self._fixed
        start = time.perf_counter()
        lib.pipeserve_decode_step(dims, eps, scale, layers, embed, norm, rope, head, vocab, ids.ctypes.data,
                                  pos.ctypes.data, slots.ctypes.data, tables.ctypes.data, tables.shape[1],
                                  lens.ctypes.data, n, lora_rows, self._lora_kinds, hidden, logits,
                                  torch.get_num_threads())
        self.seconds += time.perf_counter() - start
        if self.logits is not None:
            return self.logits[:n]
        with torch.inference_mode():
            out: torch.Tensor = _LOGITS(self.model, self.hidden[:n].to(self.dtype))
        return out


class NativeExecutor:
    """The native step as a step executor: any step of up to max_rows rows (decode, verification
    and prefill chunks' rows alike), read from the host arrays where they lie."""

    mode = NATIVE

    def __init__(self, *, model: LlamaForCausalLM, pool: KVPool, buffers: StepBuffers, max_rows: int) -> None:
        # From the row count at which the GEMM wins for most of the weight, steps run per op.
        gemm = gemm_rows([m for m in _linears(model) if isinstance(m, CpuLinear)])
        self.max_rows = max(max_rows, NATIVE_MERGED_ROWS) if gemm is None else min(
            max(max_rows, NATIVE_MERGED_ROWS), gemm - 1)
        self.gemm_rows = gemm
        self.buffers = buffers
        self.pool = pool
        self.step = NativeStep(model, pool, self.max_rows)

    def prepare(self, every_bucket: bool = False) -> None:
        """Nothing to compile: the kernels were built when the backend loaded."""

    def covers(self, flat: FlatBatch) -> bool:
        return 0 < flat.num_rows <= self.max_rows

    def run(self, flat: FlatBatch) -> torch.Tensor | None:
        ids = flat.input_ids
        if flat.device_ids is not None:  # the device is the host here: the values are readable as they lie
            ids = ids.copy()
            ids[flat.device_ids.rows] = flat.device_ids.values.numpy()
        logits = self.step(ids, flat.positions, flat.slot_mapping,
                           self.pool.block_table[flat.row_slots], flat.positions + 1, flat.row_slots)
        return select_rows(logits, flat, self.buffers)
