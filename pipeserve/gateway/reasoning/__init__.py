"""Reasoning parsers by `--reasoning-parser` name, one module each behind base.ReasoningParser."""

from __future__ import annotations

from pipeserve.gateway.reasoning.base import ReasoningParser, Split
from pipeserve.gateway.reasoning.deepseek_r1 import DeepSeekR1Parser
from pipeserve.gateway.reasoning.qwen3 import Qwen3Parser

PARSERS: dict[str, type[ReasoningParser]] = {"deepseek_r1": DeepSeekR1Parser, "qwen3": Qwen3Parser}

__all__ = ["PARSERS", "ReasoningParser", "Split"]
