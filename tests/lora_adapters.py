"""Random PEFT LoRA adapters for tests (built with peft on a Hugging Face checkpoint, B drawn nonzero so
that the adapter changes the output), and Hugging Face PEFT's greedy tokens as the reference."""

from __future__ import annotations

from typing import Any

import torch

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
