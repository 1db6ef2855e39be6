"""Quantize a loaded Llama-family model in place, at load time, from its ordinary float weights.

What each method touches (embeddings, lm_head and norms always stay in the model's dtype):
- w8a8-int8 / w8a8-fp8: qkv_proj, gate_up_proj and down_proj become W8A8 GEMMs. Their inputs are
  quantized per token where they are produced: RMSNorm + quantization (qkv, gate_up) and
  SiLU-and-mul + quantization (down_proj), one fused pass each. o_proj stays in float, as in
  PPL.LLM: its input comes from attention, not from a norm, so quantizing it needs a separate pass
  (`o_proj=True` does it, for the trade-off table of `pipeserve bench quant`).
- w4a16 / nf4: the same projections hold 4-bit weights (group 128, or K when K < 128); activations
  stay in float, so nothing else changes.
`per_tensor=True` (W8A8 only) is the ablation: one scale per weight tensor and one dynamic scale per
activation tensor, no fusion.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from torch import nn

from services.config import QUANTIZATIONS
from services.engine.backend import Backend, get_backend
from services.engine.quantization.fused import QuantRMSNorm, SiluMulQuant
from services.engine.quantization.linear import W8A8_DTYPES, W4A16Linear, W8A8Linear

from .llama import DecoderLayer, LlamaForCausalLM

log = logging.getLogger(__name__)

WEIGHT_ONLY = {"w4a16": "int4", "nf4": "nf4"}


def quantize_model(model: LlamaForCausalLM, method: str, backend: Backend | str | None = None, *,
                   per_tensor: bool = False, o_proj: bool = False) -> LlamaForCausalLM:
    """Quantize `model` in place with `method`; the quantized layers run on `backend` (by default
    the model's own)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    if method == "none":
        return model
    if per_tensor and method not in W8A8_DTYPES:
        raise ValueError("per-tensor scaling is an ablation of the W8A8 methods only")
    before = weight_bytes(model)
    if backend is None:
        backend = model.backend
    elif isinstance(backend, str):
        backend = get_backend(backend)
    for layer in cast(list[DecoderLayer], model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        names: list[tuple[nn.Module, str]] = [(attn, "qkv_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")]
        names += [(attn, "o_proj")] if o_proj else []
        if method in WEIGHT_ONLY:
            for parent, name in names:
                setattr(parent, name, W4A16Linear(getattr(parent, name), WEIGHT_ONLY[method], backend))
            continue
        dtype = W8A8_DTYPES[method]
        for parent, name in names:
            setattr(parent, name, W8A8Linear(getattr(parent, name), dtype, backend, per_tensor))
        if not per_tensor:
            for name in ("input_layernorm", "post_attention_layernorm"):
                norm = getattr(layer, name)
                setattr(layer, name, QuantRMSNorm(norm.weight, norm.eps, dtype, backend))
            mlp.act_fn = SiluMulQuant(dtype, backend)
    if model.embed_tokens.weight.is_cuda:
        torch.cuda.empty_cache()  # hand the float weights' memory back so the KV pool can take it
    log.info("quantized %s: %s%s%s, weights %.2f -> %.2f MiB", model.config.name, method,
             " per-tensor" if per_tensor else "", " +o_proj" if o_proj else "", before / 2**20,
             weight_bytes(model) / 2**20)
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds (parameters and persistent buffers: codes, scales,
    zero points), each shared tensor once."""
    seen: dict[int, int] = {}
    for tensor in model.state_dict(keep_vars=True).values():
        seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())
