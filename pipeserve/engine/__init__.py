"""The engine: the only process that touches the GPU."""

from pipeserve.engine.llm import LLM, RequestOutput
from pipeserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
