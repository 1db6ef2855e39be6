"""The one interface of the reasoning parsers: split a model's output into its reasoning section
and the content after it, whole (`parse`) or as it streams (`feed`). A tag's possible beginning at
the end of streamed text is held back until decided, so the streamed pieces join to the whole split.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeserve.gateway.tool_parsers.base import partial_suffix
from pipeserve.reasoning import FORMATS, ReasoningFormat


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """A `<start>reasoning<end>content` format (pipeserve/reasoning.py names them)."""

    name = ""

    def __init__(self) -> None:
        self.format: ReasoningFormat = FORMATS[self.name]
        self.text = ""  # everything so far
        self.sent = 0  # characters of text already split out
        self.state = "start"  # start (undecided), reasoning, content
        self.reasoned = False  # a reasoning section began

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none."""
        fresh = type(self)()
        split = fresh.feed(text, True)
        return (split.reasoning if fresh.reasoned else None), (split.content or None)

    def feed(self, new: str, last: bool) -> Split:
        """The reasoning and content of new text (last: the output ended)."""
        self.text += new
        out = Split()
        while True:
            rest = self.text[self.sent :]
            if self.state == "start":
                start = self.format.start
                if rest.startswith(start):
                    self.sent += len(start)
                    self.state, self.reasoned = "reasoning", True
                elif start.startswith(rest) and not last:
                    return out  # maybe the opening tag: wait
                else:
                    self.state = "reasoning" if self.format.implicit_start else "content"
                    self.reasoned = self.format.implicit_start
                continue
            if self.state == "reasoning":
                end = rest.find(self.format.end)
                if end >= 0:
                    out.reasoning += rest[:end]
                    self.sent += end + len(self.format.end)
                    self.state = "content"
                    continue
                keep = 0 if last else partial_suffix(rest, self.format.end)
                out.reasoning += rest[: len(rest) - keep]
                self.sent += len(rest) - keep
                return out
            out.content += rest
            self.sent = len(self.text)
            return out
