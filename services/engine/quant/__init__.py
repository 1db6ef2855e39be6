"""Quantized serving: load-time quantization of an ordinary checkpoint (W8A8 int8 / fp8, W4A16 int4
/ nf4), the quantized linear layers and fused norm/activation quantization that run it, and the
teacher-forced perplexity used to gate its accuracy. The KV-cache formats live with the KV pool and
the attention ops (services/engine/ops/kv_quant.py)."""

from .model import quantize_model, weight_bytes

__all__ = ["quantize_model", "weight_bytes"]
