"""The one interface every tool-call parser implements, and the streaming machinery they share.

A parser knows where its calls begin in the model's text (`find_start`), how much of a text's tail
might still become that beginning (`hold`), how much of the call section is complete so far
(`complete`) and how to read calls out of a complete section (`parse_section`; None when the text
is not what the format promised: then it is plain content, as vLLM returns it). `parse` reads a
whole output; `ToolStream` turns the same rules into streaming deltas: text before the calls goes
out as content at once, each call once it is complete, or, for a parser that reads a call still
being written (`partial_call`: hermes), its name as soon as it is known and its arguments as they
are generated, as vLLM streams them.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def arguments_text(value: Any) -> str:
    """Arguments as JSON text (a parser that read them as an object writes them back compact)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def call_from(obj: Any, arguments_key: str) -> ToolCall | None:
    """A call from a decoded {"name": ..., arguments_key: {...}} object; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], arguments_text(args))


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolParser(ABC):
    """One tool-call format."""

    @abstractmethod
    def find_start(self, text: str) -> int | None:
        """Where the call section begins in text; None: not (yet) there."""

    @abstractmethod
    def hold(self, text: str) -> int:
        """How many trailing characters of text (with no call section yet) may still begin one."""

    def complete(self, section: str) -> int:
        """How much of a call section (from its start) is complete calls that parse now; the rest
        waits for more text or the end. Default: nothing before the end."""
        return 0

    def partial_call(self, text: str) -> tuple[str, str] | None:
        """The call being written in text (what follows the complete calls): its name and the part
        of its arguments text that is final so far (a prefix of what parse_section will read), or
        None (not known yet, or the format is not streamed call by call). Default: None."""
        return None

    @abstractmethod
    def parse_section(self, section: str) -> tuple[list[ToolCall], str] | None:
        """The calls of a call section and the text around them; None: it is no call section."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output: (content outside the calls, the calls)."""
        start = self.find_start(text)
        parsed = None if start is None else self.parse_section(text[start:])
        if start is None or parsed is None:
            return text, []
        calls, rest = parsed
        return text[:start] + rest, calls


@dataclass
class StreamPiece:
    """What one step of a stream sends: content text and tool-call deltas (OpenAI's shape)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


class ToolStream:
    """A parser applied to a stream of text: feed() each new text, last=True at the end."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser, self.max_calls = parser, max_calls
        self.text = ""  # everything so far
        self.sent = 0  # characters of text already sent as content or consumed by calls
        self.start: int | None = None  # where the call section begins
        self.calls: list[ToolCall] = []
        self.open: ToolCall | None = None  # a call announced while still being written (partial_call)

    def feed(self, new: str, last: bool) -> StreamPiece:
        self.text += new
        piece = StreamPiece()
        if self.start is None:
            self.start = self.parser.find_start(self.text)
            if self.start is None:
                end = len(self.text) if last else len(self.text) - self.parser.hold(self.text)
                piece.content, self.sent = self.text[self.sent : end], max(self.sent, end)
                return piece
            piece.content, self.sent = self.text[self.sent : self.start], self.start
        section = self.text[self.sent :]
        ready = len(section) if last else self.parser.complete(section)
        parsed = self.parser.parse_section(section[:ready]) if ready else None
        if parsed is not None:
            calls, rest = parsed
            self.sent += ready
            piece.content += rest
            for call in calls:
                self._emit(call, piece)
        elif ready and last and self.open is None:  # never a call section: the text is content
            piece.content += section
            self.sent = len(self.text)
        partial = self.parser.partial_call(self.text[self.sent :]) if self.sent < len(self.text) else None
        if partial is not None and self._room():
            name, arguments = partial
            if self.open is None:
                self.open = ToolCall(name, "")
                piece.calls.append({"index": len(self.calls), "id": self.open.id, "type": "function",
                                    "function": {"name": name, "arguments": ""}})
            fragment = arguments[len(self.open.arguments):]
            if fragment:
                self.open.arguments += fragment
                piece.calls.append({"index": len(self.calls), "function": {"arguments": fragment}})
        if last and self.open is not None:  # cut short (or broken) while written: it stays the call it
            self.calls.append(self.open)  # was announced as, with the arguments streamed (as vLLM)
            self.open = None
            self.sent = len(self.text)
        return piece

    def _room(self) -> bool:
        return self.max_calls is None or len(self.calls) < self.max_calls

    def _emit(self, call: ToolCall, piece: StreamPiece) -> None:
        """A complete call's deltas: its head (unless announced while written), then its arguments
        (what was not streamed yet)."""
        index = len(self.calls)
        if self.open is not None:  # the call announced while being written: its id, the rest of its text
            call.id, sent = self.open.id, self.open.arguments
            self.open = None
            if not call.arguments.startswith(sent):  # cannot happen for a prefix-exact parser
                sent = ""
        elif self._room():
            sent = ""
            piece.calls.append({"index": index, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": ""}})
        else:
            return
        self.calls.append(call)
        if call.arguments[len(sent):]:
            piece.calls.append({"index": index, "function": {"arguments": call.arguments[len(sent):]}})
