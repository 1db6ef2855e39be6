"""The backends' common interface: the op protocols, `Backend` (every op and the backend's
specifics) and the names of its ops. pipeserve/engine/backend/__init__.py says what each backend is."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch
from torch import nn

from .lora_ops import LoRARows

QuantOut = tuple[torch.Tensor, torch.Tensor]
NormOut = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
NormQuantOut = QuantOut | tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class StoreKV(Protocol):
    def __call__(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        """Write new K/V rows into their cache slots (quantizing when scales are given)."""


class DecodeAttention(Protocol):
    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None, max_seq_len: int | None = None, *,
                 k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q [Bd, Hq, D], one query per request at position seq_len - 1 -> [Bd, Hq, D]."""


class PrefillAttention(Protocol):
    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor,
                 max_q_len: int, max_seq_len: int, scale: float, sliding_window: int | None = None, *,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Causal varlen attention of prefill chunks (their K/V already stored) -> [Tp, Hq, D]."""


class RMSNormOp(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> NormOut:
        """norm(x), or (norm(x + residual), x + residual)."""


class ApplyRope(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> None:
        """Rotate q and k in place at their positions (rotate-half layout)."""


class SiluAndMul(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""


class PerTokenQuant(Protocol):
    def __call__(self, x: torch.Tensor, dtype: torch.dtype = torch.int8) -> QuantOut:
        """x [T, K] -> (codes, fp32 scale [T, 1])."""


class RMSNormQuant(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None,
                 quant_dtype: torch.dtype = torch.int8) -> NormQuantOut:
        """RMSNorm quantized per token: (codes, scale), plus x + residual with a residual."""


class SiluAndMulQuant(Protocol):
    def __call__(self, x: torch.Tensor, quant_dtype: torch.dtype = torch.int8) -> QuantOut:
        """silu_and_mul quantized per token."""


class ScaledGemm(Protocol):
    def __call__(self, a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """W8A8: (a [M, K] @ w [N, K]^T) * a_scale [M, 1] * w_scale [N] + bias -> out_dtype [M, N]."""


class W4A16Gemm(Protocol):
    def __call__(self, a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None = None) -> torch.Tensor:
        """a [M, K] x packed 4-bit W [N, K] -> [M, N] in a's dtype (zeros: int4; None: nf4)."""


class FusedMoE(Protocol):
    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 top_k: int, renormalize: bool) -> torch.Tensor:
        """Mixture of experts: x [T, H] routed by router_logits [T, E] to its top_k experts by
        softmax (fp32; renormalize: the k weights rescaled to sum to 1), each expert e computing
        w2[e] @ silu_and_mul(w13[e] @ x) (w13 [E, 2I, H] = [gate | up], w2 [E, H, I]), summed with
        the routing weights -> [T, H] in x's dtype."""


class FusedMoEW8A8(Protocol):
    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                 w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, top_k: int,
                 renormalize: bool) -> torch.Tensor:
        """fused_moe with W8A8 experts: int8 / fp8 codes w13 [E, 2I, H], w2 [E, H, I] with fp32 scales
        per output channel [E, 2I] / [E, H]; each GEMM's input quantized per token on the fly."""


class FusedMoEW4A16(Protocol):
    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                 w13_scales: torch.Tensor, w13_zeros: torch.Tensor | None, w2: torch.Tensor,
                 w2_scales: torch.Tensor, w2_zeros: torch.Tensor | None, top_k: int,
                 renormalize: bool) -> torch.Tensor:
        """fused_moe with 4-bit experts: per expert the W4A16 layout of w4a16_gemm (qweight int32
        [E, K // 8, N], scales [E, K // group, N], uint8 zeros for int4 or None for nf4), K zero-padded
        to a whole number of groups; activations in float."""


class AddLoRA(Protocol):
    def __call__(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 rows: LoRARows) -> None:
        """y [T, out] += each LoRA row's (x @ A^T_slot) @ B_slot, slot tables a [S, in, N] (A
        transposed) and b [S, N, out] (lora_ops.py: the rows' index and the torch path)."""


class AddLoRASlots(Protocol):
    def __call__(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """add_lora with every row's slot read from slots [T] int32 on the device (-1: none): fixed
        shapes and no host sync, what compiled steps trace or capture (lora_ops.add_lora_slots)."""


@dataclass(frozen=True)
class Backend:
    name: str
    store_kv: StoreKV
    decode_attention: DecodeAttention
    prefill_attention: PrefillAttention
    rms_norm: RMSNormOp
    apply_rope: ApplyRope
    silu_and_mul: SiluAndMul
    per_token_quant: PerTokenQuant
    rms_norm_quant: RMSNormQuant
    silu_and_mul_quant: SiluAndMulQuant
    int8_gemm: ScaledGemm
    fp8_gemm: ScaledGemm
    w4a16_gemm: W4A16Gemm
    fused_moe: FusedMoE
    fused_moe_w8a8: FusedMoEW8A8
    fused_moe_w4a16: FusedMoEW4A16
    add_lora: AddLoRA
    add_lora_slots: AddLoRASlots
    # Its specifics (not ops): see the module docstring.
    prepare_model: Callable[[nn.Module], None] = field(default=lambda model: None)
    compiled_step: tuple[tuple[str, str], ...] = ()  # (device type, executor mode): hashable, as ops are
    native_step: bool = False

    def compiled_step_on(self, device_type: str) -> str | None:
        """The compiled step executor this backend offers on that device type, or None."""
        return dict(self.compiled_step).get(device_type)

    @classmethod
    def collect(cls, name: str, *namespaces: Mapping[str, Any], **specifics: Any) -> Backend:
        """The backend whose every op is the function of the op's name in the first namespace (a
        module's vars()) that defines one."""
        ops = {op: next(ns[op] for ns in namespaces if op in ns) for op in OP_NAMES}
        return cls(name, **ops, **specifics)


SPECIFICS = ("name", "prepare_model", "compiled_step", "native_step")
OP_NAMES = tuple(f.name for f in fields(Backend) if f.name not in SPECIFICS)
