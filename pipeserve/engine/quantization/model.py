"""Quantize a loaded Llama-family model in place, at load time, from its ordinary float weights.

What each method touches (embeddings, lm_head and norms always stay in the model's dtype):
- w8a8-int8 / w8a8-fp8: qkv_proj, gate_up_proj and down_proj become W8A8 GEMMs. Their inputs are
  quantized per token where they are produced: RMSNorm + quantization (qkv, gate_up) and
  SiLU-and-mul + quantization (down_proj), one fused pass each. o_proj stays in float, as in
  PPL.LLM: its input comes from attention, not from a norm, so quantizing it needs a separate pass
  (`o_proj=True` does it, for the trade-off table of `pipeserve bench quant`).
- Mixtures of experts: the same for attention, dense MLPs and a shared expert; the routed experts'
  gate/up and down weights are quantized per expert (quantization/experts.py) and run in the fused
  MoE's W8A8 / W4A16 variants, which quantize their inputs per token themselves: the router reads
  the post-attention norm's output in float, so that norm stays float in a sparse layer.
- w4a16 / nf4: the same projections hold 4-bit weights (group 128, or K when K < 128); activations
  stay in float, so nothing else changes.
`per_tensor=True` (W8A8 only) is the ablation: one scale per weight tensor and one dynamic scale per
activation tensor, no fusion. `fuse_inputs=False` (W8A8) keeps the norms and the activation in float
and lets each W8A8 linear quantize its own input per token (the same codes, one more pass each): LoRA
adapters wrap those linears and read the float activations, y = W8A8(x) + (x A^T) B.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from torch import nn

from pipeserve.config import QUANTIZATIONS
from pipeserve.engine.backend import Backend, get_backend
from pipeserve.engine.model.llama import MLP, DecoderLayer, LlamaForCausalLM
from pipeserve.engine.model.moe import Experts, MoE

from .experts import W4A16Experts, W8A8Experts
from .fused import QuantRMSNorm, SiluMulQuant
from .linear import W8A8_DTYPES, W4A16Linear, W8A8Linear

log = logging.getLogger(__name__)

WEIGHT_ONLY = {"w4a16": "int4", "nf4": "nf4"}


def quantize_model(model: LlamaForCausalLM, method: str, backend: Backend | str | None = None, *,
                   per_tensor: bool = False, o_proj: bool = False) -> LlamaForCausalLM:
    """Quantize `model` in place with `method`; the quantized layers run on `backend` (by default
    the model's own)."""
    check_method(method, per_tensor)
    if method == "none":
        return model
    before = weight_bytes(model)
    if backend is None:
        backend = model.backend
    elif isinstance(backend, str):
        backend = get_backend(backend)
    for layer in cast(list[DecoderLayer], model.layers):
        quantize_layer(layer, method, backend, per_tensor=per_tensor, o_proj=o_proj)
    if model.embed_tokens.weight.is_cuda:
        torch.cuda.empty_cache()  # hand the float weights' memory back so the KV pool can take it
    log.info("quantized %s: %s%s%s, weights %.2f -> %.2f MiB", model.config.name, method,
             " per-tensor" if per_tensor else "", " +o_proj" if o_proj else "", before / 2**20,
             weight_bytes(model) / 2**20)
    return model


def check_method(method: str, per_tensor: bool = False) -> None:
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    if per_tensor and method not in W8A8_DTYPES:
        raise ValueError("per-tensor scaling is an ablation of the W8A8 methods only")


def quantize_layer(layer: DecoderLayer, method: str, backend: Backend, *, per_tensor: bool = False,
                   o_proj: bool = False, fuse_inputs: bool = True) -> None:
    """Quantize one decoder layer in place (the loader calls this as soon as a layer's float
    weights are all loaded, so the whole float model never exists at once)."""
    if method == "none":
        return
    attn = layer.self_attn
    # A sparse layer's dense MLP is its shared expert, if any.
    mlp = layer.mlp.shared_expert if isinstance(layer.mlp, MoE) else layer.mlp
    if isinstance(layer.mlp, MoE):
        layer.mlp.experts = quantize_experts(layer.mlp.experts, method, backend)
    names: list[tuple[nn.Module, str]] = [(attn, "qkv_proj")]
    names += [(mlp, "gate_up_proj"), (mlp, "down_proj")] if mlp is not None else []
    names += [(attn, "o_proj")] if o_proj else []
    if method in WEIGHT_ONLY:
        for parent, name in names:
            setattr(parent, name, W4A16Linear(getattr(parent, name), WEIGHT_ONLY[method], backend))
        return
    dtype = W8A8_DTYPES[method]
    for parent, name in names:
        setattr(parent, name, W8A8Linear(getattr(parent, name), dtype, backend, per_tensor))
    if fuse_inputs and not per_tensor:
        # The router and the experts read the post-attention norm's output in float: a sparse
        # layer's shared expert quantizes its own input.
        norms = ["input_layernorm"] + ([] if isinstance(layer.mlp, MoE) else ["post_attention_layernorm"])
        for name in norms:
            norm = getattr(layer, name)
            setattr(layer, name, QuantRMSNorm(norm.weight, norm.eps, dtype, backend))
        if isinstance(mlp, MLP):
            mlp.act_fn = SiluMulQuant(dtype, backend)


def quantize_experts(experts: nn.Module, method: str, backend: Backend) -> nn.Module:
    """The routed experts of one sparse layer, quantized with `method`."""
    assert isinstance(experts, Experts)
    args = (experts.w13, experts.w2, experts.top_k, experts.renormalize)
    if method in WEIGHT_ONLY:
        return W4A16Experts(*args, WEIGHT_ONLY[method], backend)
    return W8A8Experts(*args, W8A8_DTYPES[method], backend)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds (parameters and persistent buffers: codes, scales,
    zero points; a oneDNN-reordered copy, which has no storage to point at, by its own identity),
    each shared tensor once."""
    seen: dict[int, int] = {}
    for tensor in model.state_dict(keep_vars=True).values():
        seen[id(tensor) if tensor.is_mkldnn else tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())
