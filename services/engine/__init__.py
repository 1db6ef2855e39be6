"""The engine: the only process that touches the GPU."""

from services.engine.llm import LLM, RequestOutput
from services.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
