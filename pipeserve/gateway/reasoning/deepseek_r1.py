"""DeepSeek-R1: everything before `</think>` is reasoning, whether or not `<think>` was generated
(its chat template opens the section in the prompt); an output without `</think>` is all reasoning."""

from __future__ import annotations

from pipeserve.gateway.reasoning.base import ReasoningParser


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
