"""Tiny random Hugging Face checkpoints for tests (built with transformers, saved as safetensors)."""

from __future__ import annotations

import torch

# One builder for the tests and `pipeserve gpu-check`.
from pipeserve.gpu_check.models import BASE, MOE, build_tiny_model  # noqa: E402,F401


def write_fused_experts(src: str, dst: str) -> str:
    """A copy of the MoE checkpoint `src` in the fused expert layout some checkpoints ship: per
    layer, mlp.experts.gate_up_proj [E, 2I, H] (gate rows, then up) and mlp.experts.down_proj [E, H, I]
    instead of one module per expert (Mixtral's block_sparse_moe renamed to mlp, as those do)."""
    import os
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    names = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up",
             "w2": "down", "down_proj": "down"}
    pattern = re.compile(
        r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
    )
    tensors = load_file(os.path.join(src, "model.safetensors"))
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        m = pattern.match(name)
        if m is None:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
            continue
        layer, e, proj = m.group(1), int(m.group(2)), names[m.group(3)]
        experts.setdefault(layer, {}).setdefault(proj, {})[e] = tensor
    assert experts, "no per-expert tensors in the source checkpoint"
    for layer, projs in experts.items():
        stack = {p: torch.stack([projs[p][e] for e in sorted(projs[p])]) for p in ("gate", "up", "down")}
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1).contiguous()
        out[f"{layer}.mlp.experts.down_proj"] = stack["down"].contiguous()
    os.remove(os.path.join(dst, "model.safetensors"))
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst
