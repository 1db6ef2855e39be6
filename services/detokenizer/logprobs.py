"""Logprobs as the gateway sends them: each sampled token and its top alternatives with their text."""

from __future__ import annotations

from typing import Any

import numpy as np

from services.messages import MessageError, unpack_ids


class TokenTexts:
    """The text of single tokens as each reads inside running text: decoded after an anchor token,
    so SentencePiece's leading space survives (decode([id]) alone strips it). Cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
        self._anchor_text = self._decode(self._anchor)
        self._cache: dict[int, str] = {}

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def __getitem__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            full = self._decode(self._anchor + [token_id])
            if full.startswith(self._anchor_text):
                text = full[len(self._anchor_text):]
            else:
                text = self._decode([token_id])
            self._cache[token_id] = text
        return text


def format_logprobs(token_id: int, row: Any, texts: TokenTexts) -> dict[str, Any]:
    """StepOutput.logprobs row [sampled logprob, packed top ids, packed float32 top logprobs] ->
    {"token_id", "token", "logprob", "top": [{"token_id", "token", "logprob"}, ...]}."""
    if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], (int, float))
            and isinstance(row[1], bytes) and isinstance(row[2], bytes)):
        raise MessageError(f"malformed logprobs row {row!r:.80}")
    top_ids = unpack_ids(row[1]).tolist()
    if len(row[2]) != 4 * len(top_ids):
        raise MessageError(f"{len(top_ids)} top ids but {len(row[2])} bytes of top logprobs")
    top_lps = np.frombuffer(row[2], dtype="<f4").tolist()
    top = [{"token_id": t, "token": texts[t], "logprob": lp} for t, lp in zip(top_ids, top_lps, strict=True)]
    return {"token_id": token_id, "token": texts[token_id], "logprob": float(row[0]), "top": top}
