"""A fused linear layer of the model with the adapters of its rows added: y = base(x), then
y += (x @ A_slot^T) @ B_slot for each row that uses an adapter targeting this layer (the backend's
add_lora over the step's LoRAContext index). Rows without one, and steps without any, are the base
layer's output unchanged. In a compiled step (the context's `fixed` slots) every layer runs the
backend's add_lora_slots over every row: a kind no adapter targets adds zeros (its slots are zero)."""

from __future__ import annotations

import torch
from torch import nn

from pipeserve.engine.backend import Backend
from pipeserve.engine.model.llama import LlamaForCausalLM

from .layout import MODEL_ATTR
from .rows import LoRAContext
from .slots import SlotTable


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, kind: str, a: torch.Tensor, b: torch.Tensor, context: LoRAContext,
                 backend: Backend, last: bool) -> None:
        """last: in the last layer, where o_proj and the MLP run over the rows read out only."""
        super().__init__()
        self.base, self.kind, self.context, self.last = base, kind, context, last
        self.add_lora, self.add_lora_slots = backend.add_lora, backend.add_lora_slots
        self.a: torch.Tensor
        self.b: torch.Tensor
        self.register_buffer("a", a, persistent=False)
        self.register_buffer("b", b, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        fixed = self.context.fixed
        if fixed is not None:  # a compiled step: the same ops whatever adapters its rows use
            self.add_lora_slots(y, x, self.a, self.b, fixed)
            return y
        rows = self.context.rows(self.last and self.kind != "qkv")
        if rows is not None and self.kind in rows.kinds:
            self.add_lora(y, x, self.a, self.b, rows)
        return y


def attach(model: LlamaForCausalLM, table: SlotTable, context: LoRAContext, backend: Backend) -> int:
    """Wrap every linear layer the slot table covers; the number wrapped."""
    layers = model.layers
    count = 0
    for (i, kind), (a, b) in table.tables.items():
        block, attr = MODEL_ATTR[kind]
        parent = getattr(layers[i], block)
        last = i == len(layers) - 1
        setattr(parent, attr, LoRALinear(getattr(parent, attr), kind, a, b, context, backend, last))
        count += 1
    return count
