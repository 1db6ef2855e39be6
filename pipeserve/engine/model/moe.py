"""The sparse mixture-of-experts block that replaces the dense MLP in Mixtral, Qwen2-MoE and Qwen3-MoE.

A router (`gate`, a [E, hidden] linear) scores every token against the E experts; the backend's
fused_moe takes the softmax's top-k experts per token (their weights renormalized to sum to 1 when
the model says so), runs each expert's SiLU-gated MLP on the tokens routed to it and sums the
outputs weighted by the routing weights. Expert weights are held as 3-D tensors, one slice per
expert, in the fused layout the grouped GEMM reads: w13 [E, 2I, hidden] ([gate | up] rows, like the
dense MLP's gate_up_proj) and w2 [E, hidden, I]. Qwen2-MoE adds a shared expert every token runs,
scaled by sigmoid(shared_expert_gate(x)).
"""

from __future__ import annotations

import torch
from torch import nn

from pipeserve.engine.backend import Backend
from pipeserve.model_config import ModelConfig


class Experts(nn.Module):
    """The routed experts' weights and the grouped computation over them (backend.fused_moe)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int, renormalize: bool,
                 backend: Backend) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.top_k, self.renormalize = top_k, renormalize
        self.backend = backend

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.backend.fused_moe(x, router_logits, self.w13, self.w2, self.top_k, self.renormalize)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        # Experts, or its quantized replacement (pipeserve/engine/quantization/experts.py).
        self.experts: nn.Module = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               cfg.num_experts_per_tok, cfg.norm_topk_prob, backend)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            None if shared_expert is None else nn.Linear(cfg.hidden_size, 1, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.experts(x, self.gate(x))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
