"""Random PEFT LoRA adapters for tests (built with peft on a Hugging Face checkpoint, B drawn nonzero so
that the adapter changes the output), and Hugging Face PEFT's greedy tokens as the reference."""

from __future__ import annotations

import os
from typing import Any

import torch

from pipeserve import LoRARequest, SamplingParams

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


def build_adapter(model_dir: str, path: str, rank: int, targets: list[str], *, seed: int = 0,
                  alpha: float | None = None, rslora: bool = False, std: float = 0.1) -> Any:
    """Save a random adapter of model_dir to path; returns the PEFT model (eval mode) for references."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=targets,
                        lora_dropout=0.0, use_rslora=rslora)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)
    model.save_pretrained(path)
    return model.eval()


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of a Hugging Face (PEFT) model, one prompt at a time, EOS ignored."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


# rank, targets: rank 8 and 16 in one table of rank 16, attention-only, all-linear and an MLP subset.
MIXED = [(8, ATTENTION), (16, ALL_LINEAR), (8, ALL_LINEAR), (16, ["gate_proj", "down_proj", "o_proj"])]


def mixed_adapters(model_dir: str, folder: str, seed: int) -> list[LoRARequest]:
    """One random adapter of model_dir per MIXED entry, saved under folder: their requests (ids 1..)."""
    requests = []
    for i, (rank, targets) in enumerate(MIXED):
        path = os.path.join(folder, f"adapter{i}")
        build_adapter(model_dir, path, rank, targets, seed=seed + i)
        requests.append(LoRARequest(f"adapter{i}", i + 1, path))
    return requests


def mixed_workload(requests: list[LoRARequest],
                   seed: int) -> tuple[list[list[int]], list[SamplingParams], list[LoRARequest | None]]:
    """Eight greedy requests over three of mixed_adapters' adapters and the base, of different prompt
    and output lengths: run four at a time, the steps mix them, and each that ends lets the next one in."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 11, 3, 9, 6, 4, 13, 7)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (4, 12, 7, 9, 5, 10, 6, 8)]
    loras = [requests[0], requests[1], None, requests[2], requests[1], None, requests[0], requests[2]]
    return prompts, params, loras
