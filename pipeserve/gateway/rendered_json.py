"""JSON bodies with pieces already rendered elsewhere: the detokenizer renders OpenAI logprobs
(messages.LogprobsJSON), and the HTTP front end only splices them into its responses, so its event
loop never walks a top-k table.

`dumps` writes what `json.dumps(..., ensure_ascii=False, separators=(",", ":"))` writes, a `Raw`
value written as its text. Each Raw is first written as a string of a per-process random marker
(json calls `default` for it, in document order), then the markers are replaced in one pass; no
client text can forge the marker.
"""

from __future__ import annotations

import itertools
import json
import secrets
from collections.abc import Iterable
from typing import Any

from pipeserve.messages import LogprobsJSON, unpack_ids

_MARKER = f"\x00{secrets.token_hex(16)}\x00"
_WRITTEN = json.dumps(_MARKER)  # the marker as json writes it, quotes included


class Raw:
    """A JSON value already written."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def dumps(payload: Any) -> str:
    raws: list[str] = []

    def marker(value: Any) -> str:
        if not isinstance(value, Raw):
            raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
        raws.append(value.text)
        return _MARKER

    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), default=marker)
    if not raws:
        return text
    pieces = text.split(_WRITTEN)
    if len(pieces) != len(raws) + 1:
        raise AssertionError("a spliced JSON value's marker was not written once")
    out = [pieces[0]]
    for raw, piece in zip(raws, pieces[1:], strict=True):
        out += (raw, piece)
    return "".join(out)


class Logprobs:
    """A choice's logprob entries as the detokenizer rendered them, joined only when written."""

    __slots__ = ("arrays", "lengths", "count")

    def __init__(self, pieces: Iterable[LogprobsJSON | None] = ()) -> None:
        self.arrays: list[list[str]] = []
        self.lengths: list[int] = []  # each entry's token text length
        self.count = 0
        for piece in pieces:
            self.add(piece)

    def __bool__(self) -> bool:
        return self.count > 0

    def add(self, piece: LogprobsJSON | None) -> None:
        if piece is None:
            return
        lengths = unpack_ids(piece.lengths).tolist()
        if not lengths:
            return
        if not self.arrays:
            self.arrays = [[] for _ in piece.parts]
        for elements, part in zip(self.arrays, piece.parts, strict=True):
            elements.append(part)
        self.lengths += lengths
        self.count += len(lengths)

    def __add__(self, other: Logprobs) -> Logprobs:
        out = Logprobs()
        for source in (self, other):
            if source:
                out.arrays = out.arrays or [[] for _ in source.arrays]
                for elements, more in zip(out.arrays, source.arrays, strict=True):
                    elements += more
                out.lengths += source.lengths
                out.count += source.count
        return out

    def _array(self, j: int) -> str:
        return "[" + ",".join(self.arrays[j]) + "]" if self.arrays else "[]"

    def completion(self, offset: int) -> Raw:
        """OpenAI's completion logprobs; text_offset counts from offset (the text sent before)."""
        starts = itertools.accumulate(self.lengths[:-1], initial=offset) if self.lengths else ()
        return Raw(f'{{"tokens":{self._array(0)},"token_logprobs":{self._array(1)},'
                   f'"top_logprobs":{self._array(2)},"text_offset":[{",".join(map(str, starts))}]}}')

    def chat(self) -> Raw:
        """OpenAI's chat logprobs."""
        return Raw(f'{{"content":{self._array(0)}}}')
