"""Tool-call parsers by `--tool-call-parser` name, each in its own module behind one interface
(base.ToolParser: parse a whole output, or a stream through base.ToolStream)."""

from __future__ import annotations

from pipeserve.gateway.tool_parsers.base import StreamPiece, ToolCall, ToolParser, ToolStream
from pipeserve.gateway.tool_parsers.hermes import HermesParser
from pipeserve.gateway.tool_parsers.json_list import JsonListParser
from pipeserve.gateway.tool_parsers.llama3_json import Llama3JsonParser
from pipeserve.gateway.tool_parsers.mistral import MistralParser
from pipeserve.gateway.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}

__all__ = ["PARSERS", "JsonListParser", "StreamPiece", "ToolCall", "ToolParser", "ToolStream"]
