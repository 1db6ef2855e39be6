"""Triton kernels, one file per family; pipeserve/engine/backend/triton.py binds them into the
"triton" backend. Tests run them on the CPU under TRITON_INTERPRET=1 (set before this package is
imported) against the reference backend, and compile each for sm_90 with Triton's real compiler.

- common.py: launcher helpers (interpreter detection, dtypes, autotune, GEMM tiling and split-K)
- quantize.py: int8 / fp8 code helpers, per-token activation quantization
- kv_cache.py: the paged cache as a kernel argument, K/V store (quantizing), tile loader
- attention.py: the online-softmax loop both attention kernels run
- decode_attention.py: flash-decoding; prefill_attention.py: FlashAttention-2, causal, varlen
- norm.py (RMSNorm [+ residual] [+ quant]), activation.py (SiLU-and-mul [+ quant]), rope.py
- gemm_w8a8.py: int8 / fp8 W8A8 GEMM; gemm_w4a16.py: int4 / NF4 weight-only GEMM
- lora.py: batched LoRA, Punica's shrink/expand (gathered rows: BGMV; prefill segments: SGMV)
"""
