"""pipeserve: a pipelined LLM inference server.

`from pipeserve import LLM, SamplingParams, LoRARequest`: the offline API. The names resolve on first use, so
importing the package (as every `pipeserve` command does) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeserve.engine.llm import LLM
    from pipeserve.lora import LoRARequest
    from pipeserve.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pipeserve.engine.llm import LLM

        return LLM
    if name == "LoRARequest":
        from pipeserve.lora import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from pipeserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pipeserve' has no attribute {name!r}")
