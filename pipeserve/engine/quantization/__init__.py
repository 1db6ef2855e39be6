"""Quantized layers: load-time weight quantizers (weights.py), the quantized linears that replace
nn.Linear (linear.py) and the norms / activation fused with their per-token quantization (fused.py).
Every op they run comes from the model's backend. Quantizing a whole model:
pipeserve/engine/quantization/model.py; the quantized KV cache: pipeserve/engine/quantization/kv_cache.py."""
