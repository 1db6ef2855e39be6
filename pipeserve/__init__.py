"""pipeserve: a pipelined LLM inference server.

`from pipeserve import LLM, SamplingParams` is the offline API. The names resolve on first use, so
importing the package (as every `pipeserve` command does) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeserve.engine.llm import LLM
    from pipeserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pipeserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pipeserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pipeserve' has no attribute {name!r}")
