"""Logprobs rendered as the OpenAI API's JSON, in the detokenizer process: the gateway splices these
pieces into its responses as they are, so the per-token work of top-k tables over n choices never
runs on the gateway's event loop (where it would delay every other stream, /health and /metrics).

The text is exactly what `json.dumps(..., ensure_ascii=False, separators=(",", ":"))` writes for
OpenAI's objects: completion logprobs {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
(a token without a logprob, the echoed first prompt token, has null in both) and chat logprobs
{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
The gateway adds the brackets and text_offset (it alone knows how much text a choice sent).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from pipeserve.detokenizer.logprobs import TokenTexts
from pipeserve.messages import LogprobsJSON, pack_ids

COMPLETION, CHAT = "completion", "chat"
ARRAYS = {COMPLETION: 3, CHAT: 1}  # the arrays of each format whose elements LogprobsJSON.parts carry


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _float(value: float) -> str:
    """A float as json.dumps spells it (repr; NaN and infinities by name)."""
    return float.__repr__(value) if math.isfinite(value) else _dumps(value)


def _floats(values: list[float]) -> Iterable[str]:
    """Each float as json.dumps spells it; when every one is finite (their sum is: logprobs never
    overflow it), by repr alone, without a call per value."""
    return map(float.__repr__, values) if math.isfinite(sum(values)) else map(_float, values)


@dataclass
class Pieces:
    """Entries rendered so far for one row: each array's elements, and each entry's text length."""

    arrays: list[list[str]]
    lengths: list[int] = field(default_factory=list)

    def message(self) -> LogprobsJSON:
        return LogprobsJSON([",".join(elements) for elements in self.arrays], pack_ids(self.lengths))


class Renderer:
    """Renders entries (a token, its logprob and its top alternatives) in one of the formats; each
    token's JSON pieces are cached by id."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self._token: dict[int, str] = {}  # id -> its text as a JSON string
        self._key: dict[int, str] = {}  # id -> its text as a JSON object's key, '"text":'
        self._chat: dict[int, tuple[str, str]] = {}  # id -> ('{"token":T,"logprob":', ',"bytes":[..]')

    def pieces(self, fmt: str) -> Pieces:
        return Pieces([[] for _ in range(ARRAYS[fmt])])

    def add(self, into: Pieces, fmt: str, token_id: int, logprob: float, top_ids: list[int],
            top_logprobs: list[float]) -> None:
        """One entry into pieces; in completions a NaN logprob (the first prompt token) has no
        logprob and no top (null). The top entries close with "}", the sampled one after them."""
        into.lengths.append(len(self.texts[token_id]))
        if fmt == CHAT:
            head, tail = self._chat_parts(token_id)
            tops = ",".join([f"{top[0]}{lp}{top[1]}}}" for top, lp in
                             zip(map(self._chat_parts, top_ids), _floats(top_logprobs), strict=True)])
            into.arrays[0].append(f'{head}{_float(logprob)}{tail},"top_logprobs":[{tops}]}}')
            return
        tokens, values, tops_out = into.arrays
        tokens.append(self._token_json(token_id))
        if math.isnan(logprob):
            values.append("null")
            tops_out.append("null")
            return
        values.append(_float(logprob))
        # A dict, as OpenAI's top_logprobs is: joined from each id's cached key; ids whose texts are
        # equal keep one key (the last value), as json.dumps of the dict writes them.
        keys = [self._key.get(t) or self._key_json(t) for t in top_ids]
        if len(set(keys)) == len(keys):
            tops_out.append("{" + ",".join(map(str.__add__, keys, _floats(top_logprobs))) + "}")
        else:
            texts = self.texts
            tops_out.append(_dumps({texts[t]: lp for t, lp in zip(top_ids, top_logprobs, strict=True)}))

    def _token_json(self, token_id: int) -> str:
        text = self._token.get(token_id)
        if text is None:
            text = self._token[token_id] = _dumps(self.texts[token_id])
        return text

    def _key_json(self, token_id: int) -> str:
        key = self._key[token_id] = self._token_json(token_id) + ":"
        return key

    def _chat_parts(self, token_id: int) -> tuple[str, str]:
        parts = self._chat.get(token_id)
        if parts is None:
            text = self.texts[token_id]
            parts = self._chat[token_id] = (f'{{"token":{self._token_json(token_id)},"logprob":',
                                            f',"bytes":{_dumps(list(text.encode()))}')
        return parts
