"""Load a Hugging Face checkpoint directory (config.json + single or sharded safetensors) into our
model, fusing q/k/v and gate/up on the fly. Mixture-of-experts checkpoints come in two layouts,
both read here: one module per expert (`experts.N.w1` / `experts.N.gate_proj`, what transformers
saves) and fused 3-D expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]). Every parameter must be filled exactly once.

Weights stream in: file by file, tensor by tensor, each read into host memory, cast to the serving
dtype and copied into its place. The model is built on the meta device and each top-level unit (the
embedding, one decoder layer, the final norm, the head) is allocated, in the serving dtype, only
when its first tensor arrives; with a quantization method a decoder layer is quantized as soon as
its last tensor is in. So neither the device nor the host ever holds the whole model in the
checkpoint's dtype (or, quantized, in float): the peak is the served model plus a layer or two.

`load_format="dummy"` fills the same units with random weights generated on the device instead:
a directory with only config.json (and a tokenizer) serves, nothing written or read."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch

from pipeserve.config import LOAD_FORMATS
from pipeserve.engine.backend import Backend
from pipeserve.engine.parallel.group import TPGroup
from pipeserve.engine.quantization.model import check_method, quantize_layer, weight_bytes
from pipeserve.model_config import ModelConfig

from .llama import DecoderLayer, LlamaForCausalLM
from .tensor_parallel import ShardPlan, TensorParallelLlama

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def resolve_dtype(dtype: str, device: torch.device, config: ModelConfig) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}")
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    checkpoint = DTYPES.get(config.torch_dtype, torch.bfloat16)
    return torch.bfloat16 if checkpoint == torch.float32 else checkpoint


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return [os.path.join(model_dir, n) for n in names]


Index = tuple[int | slice, ...]
ALL: Index = ()
# A per-expert tensor: Mixtral's experts.N.w1 / w3 / w2, Qwen-MoE's experts.N.gate_proj / up_proj / down_proj.
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# The fused layout: all experts' [gate | up] as one [E, 2I, H] tensor, their down_proj as [E, H, I].
_FUSED_EXPERTS = {"mlp.experts.gate_up_proj": "mlp.experts.w13", "mlp.experts.down_proj": "mlp.experts.w2"}


def _target(cfg: ModelConfig, name: str) -> tuple[str, Index] | None:
    """HF tensor name -> (our parameter name, the part of it the tensor fills) or None to skip."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", ALL
    if name == "model.norm.weight":
        return "norm.weight", ALL
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else ("lm_head.weight", ALL)
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    layer, rest = m.group(1), m.group(2).replace("block_sparse_moe.", "mlp.")  # Mixtral's name
    if rest in _FUSED_EXPERTS:
        return f"layers.{layer}.{_FUSED_EXPERTS[rest]}", ALL
    expert = _EXPERT.match(rest)
    if expert is not None:
        e, proj = int(expert.group(1)), expert.group(2)
        inter = cfg.moe_intermediate_size
        if proj in ("w2", "down_proj"):
            return f"layers.{layer}.mlp.experts.w2", (e,)
        up = proj in ("w3", "up_proj")
        return f"layers.{layer}.mlp.experts.w13", (e, slice(inter if up else 0, 2 * inter if up else inter))
    q, kv = cfg.q_size, cfg.kv_size
    qkv = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    module, _, kind = rest.rpartition(".")
    parent, _, proj = module.rpartition(".")
    if parent == "self_attn" and proj in qkv:
        lo, hi = qkv[proj]
        return f"layers.{layer}.self_attn.qkv_proj.{kind}", (slice(lo, hi),)
    if parent in ("mlp", "mlp.shared_expert") and proj in ("gate_proj", "up_proj"):
        shared = parent == "mlp.shared_expert"
        inter = cfg.shared_expert_intermediate_size if shared else cfg.intermediate_size
        lo = inter if proj == "up_proj" else 0
        return f"layers.{layer}.{parent}.gate_up_proj.{kind}", (slice(lo, lo + inter),)
    return f"layers.{layer}.{rest}", ALL


# safetensors dtype codes -> torch dtypes (what a checkpoint of a Llama-family model may hold).
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


# Host memory a checkpoint tensor is read through: larger tensors are read and cast in row blocks of
# about this size, so loading never holds a whole tensor in the checkpoint's dtype beside the model.
READ_CHUNK_BYTES = 16 * 2**20


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, read on demand with plain reads (not safetensors' memory
    map: pages of a mapped file stay resident until it is closed, so a single-file checkpoint would
    count whole in the loader's memory)."""

    file: io.BufferedReader
    offset: int  # of its first byte in the file
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def read(self, start: int = 0, stop: int | None = None,
             buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Rows start..stop (along the first dimension; all by default), in `buffer` (uint8) when
        it is large enough, else in memory of their own."""
        rows = (self.shape[0] if self.shape else 1) if stop is None else stop
        nbytes = (rows - start) * self.row_bytes
        raw = (buffer[:nbytes] if buffer is not None and buffer.numel() >= nbytes
               else torch.empty(nbytes, dtype=torch.uint8, device="cpu"))
        self.file.seek(self.offset + start * self.row_bytes)
        if self.file.readinto(raw.numpy().data) != nbytes:
            raise ValueError(f"{self.file.name} is truncated")
        return raw.view(self.dtype).reshape((rows - start, *self.shape[1:]) if self.shape else ())


def read_safetensors(f: io.BufferedReader) -> Iterator[tuple[str, StoredTensor]]:
    """(name, tensor on disk) for each tensor of an open safetensors file, in file order."""
    (header_len,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{f.name}: tensor {name!r} has dtype {info['dtype']}, "
                             "which pipeserve cannot load")
        yield name, StoredTensor(f, 8 + header_len + info["data_offsets"][0], dtype, tuple(info["shape"]))


def _units(model: LlamaForCausalLM) -> dict[str, torch.nn.Module]:
    """The model's units of allocation, by name prefix: each decoder layer, and every other top-level
    module (embedding, final norm, head)."""
    units: dict[str, torch.nn.Module] = {}
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            units.update((f"{name}.{i}", layer) for i, layer in enumerate(child))
        else:
            units[name] = child
    return units


def _unit_of(param: str) -> str:
    first, _, rest = param.partition(".")
    return f"{first}.{rest.partition('.')[0]}" if first == "layers" else first


class _Materializer:
    """Allocates each unit on the device in the serving dtype when first needed, counts what was
    written into each parameter, and quantizes a decoder layer once all of its weights are in."""

    def __init__(self, model: LlamaForCausalLM, device: torch.device, quantization: str, backend: Backend,
                 fuse_inputs: bool = True):
        self.model, self.device, self.quantization, self.backend = model, device, quantization, backend
        self.fuse_inputs = fuse_inputs
        self.units = _units(model)
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        self.left: dict[str, int] = {}  # per unit: elements still to write
        for name, param in self.params.items():
            unit = _unit_of(name)
            self.left[unit] = self.left.get(unit, 0) + param.numel()
        self.filled: dict[str, int] = {name: 0 for name in self.params}

    def part(self, name: str, index: Index) -> torch.Tensor:
        param = self.params[name]
        if param.is_meta:
            self._allocate(_unit_of(name))
            param = self.params[name]
        return param[index]

    def _allocate(self, unit: str) -> None:
        module = self.units[unit]
        # Module.to_empty's empty_like of a meta tensor imports sympy (~1 s of every engine start):
        # the same allocation by shape.
        module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=self.device))  # type: ignore[no-untyped-call]
        prefix = unit + "."
        for name, param in module.named_parameters(prefix=unit):
            assert name.startswith(prefix)
            self.params[name] = param

    def wrote(self, name: str, count: int) -> None:
        self.filled[name] += count
        unit = _unit_of(name)
        self.left[unit] -= count
        if self.left[unit] == 0 and self.quantization != "none" and unit.startswith("layers."):
            layer = cast(DecoderLayer, self.units[unit])
            for pname, _ in layer.named_parameters(prefix=unit):
                del self.params[pname]  # the float weights go with the modules quantization replaces
            quantize_layer(layer, self.quantization, self.backend, fuse_inputs=self.fuse_inputs)

    def missing(self) -> list[str]:
        return [n for n, count in self.filled.items() if n in self.params and count != self.params[n].numel()]


def load_model(
    model_dir: str, backend: Backend, device: torch.device, dtype: torch.dtype, max_positions: int,
    tp: TPGroup | None = None, rope_scaling: str | None = None, *, quantization: str = "none",
    load_format: str = "auto", seed: int = 0, fuse_inputs: bool = True,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model and the checkpoint's config (rope_scaling: the --rope-scaling override); with `tp`,
    this rank's shard (its `config` is then the shard's, pipeserve/engine/model/tensor_parallel.py).
    quantization: applied layer by layer while loading. load_format: auto and safetensors read the
    checkpoint; dummy makes random weights on the device (from `seed`). fuse_inputs: W8A8 inputs
    quantized by the norms and the activation that produce them (quantization/model.py)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    check_method(quantization)
    cfg = ModelConfig.from_dir(model_dir, rope_scaling)
    shard = None if tp is None else ShardPlan(cfg, tp.rank, tp.world)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend) if tp is None else TensorParallelLlama(cfg, backend, tp)
    model.to(dtype)  # still on meta: no memory, and every unit is later allocated in this dtype
    model.init_rope(max_positions, device)
    units = _Materializer(model, device, quantization, backend, fuse_inputs)
    if load_format == "dummy":
        _fill_random(units, device, seed)
    else:
        _fill_from_checkpoint(units, cfg, model_dir, shard)
    missing = units.missing()
    if missing:
        raise ValueError(
            f"checkpoint {model_dir} lacks tensors for: {', '.join(missing[:8])}"
            + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        )
    model.eval().requires_grad_(False)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # quantization's freed float layers, so the KV pool can take them
    log.info("loaded %s (%s, %d layers) on %s as %s%s%s: weights %.1f MiB", cfg.name, cfg.architecture,
             cfg.num_layers, device, dtype, "" if quantization == "none" else f", {quantization}",
             ", random weights (load_format dummy)" if load_format == "dummy" else "",
             weight_bytes(model) / 2**20)
    return model, cfg


def _fill_from_checkpoint(units: _Materializer, cfg: ModelConfig, model_dir: str,
                          shard: ShardPlan | None) -> None:
    buffer = torch.empty(READ_CHUNK_BYTES, dtype=torch.uint8, device="cpu")  # reused for every read that fits
    for path in checkpoint_files(model_dir):
        with open(path, "rb") as f:
            for name, stored in read_safetensors(f):
                if _IGNORED.search(name):
                    continue
                target = _target(cfg, name)
                if target is None:
                    continue
                ours, index = target
                if ours not in units.params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
                if shard is not None:  # a rank's piece is cut from the whole tensor
                    index, tensor = shard.piece(ours, index, stored.read())
                    part = units.part(ours, index)
                    _copy(part, tensor, name)
                else:
                    part = units.part(ours, index)
                    if tuple(part.shape) != stored.shape:
                        raise ValueError(f"tensor {name!r} has shape {stored.shape}, "
                                         f"expected {tuple(part.shape)}")
                    step = max(1, READ_CHUNK_BYTES // max(1, stored.row_bytes))
                    rows = stored.shape[0] if stored.shape else 1
                    for start in range(0, rows, step):
                        block = stored.read(start, min(rows, start + step), buffer)
                        _copy(part[start : start + step] if stored.shape else part, block, name)
                units.wrote(ours, part.numel())


def _copy(part: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tensor.shape != part.shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(part.shape)}")
    with torch.no_grad():
        part.copy_(tensor)  # the cast to the serving dtype happens here, block by block


def _fill_random(units: _Materializer, device: torch.device, seed: int) -> None:
    """Weights as transformers initialises a Llama (normal, std 0.02; norms one, biases zero), made
    on the device unit by unit, so quantized formats are produced layer by layer as from a checkpoint."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for name in list(units.params):
        part = units.part(name, ALL)
        with torch.no_grad():
            if name.endswith("norm.weight"):
                part.fill_(1.0)
            elif name.endswith("bias"):
                part.zero_()
            else:
                part.normal_(0.0, 0.02, generator=generator)
        units.wrote(name, part.numel())
