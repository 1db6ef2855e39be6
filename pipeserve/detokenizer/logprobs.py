"""Logprobs as the gateway sends them: each sampled token and its top alternatives with their text."""

from __future__ import annotations

from typing import Any

from pipeserve.messages import (
    MessageError,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
    unpack_floats,
    unpack_ids,
)


class TokenTexts:
    """The text of single tokens as each reads inside running text: decoded after an anchor token,
    so SentencePiece's leading space survives (decode([id]) alone strips it). Cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
        self._anchor_text = self._decode(self._anchor)
        self._cache: dict[int, str] = {}

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=False)
        return text

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


# One row of a step's StepLogprobs: the sampled token's logprob, its top ids and their logprobs.
RowLogprobs = tuple[float, list[int], list[float]]


def prompt_rows(prompt: PromptLogprobs) -> list[tuple[int, float, list[int], list[float]]]:
    """Every prompt token: its id, its logprob (NaN for the first) and its top alternatives (none for
    the first), checked."""
    ids = unpack_ids(prompt.prompt_ids).tolist()
    lps = unpack_floats(prompt.logprobs).tolist()
    top_ids, top_lps = unpack_ids(prompt.top_ids), unpack_floats(prompt.top_logprobs)
    if len(lps) != len(ids) or len(top_ids) != len(top_lps) or len(top_ids) % max(1, len(ids)):
        raise MessageError(f"prompt logprobs of {len(ids)} ids: {len(lps)} logprobs, {len(top_ids)} top ids, "
                           f"{len(top_lps)} top logprobs")
    k = len(top_ids) // max(1, len(ids))
    top_id_rows, top_lp_rows = top_ids.reshape(len(ids), k).tolist(), top_lps.reshape(len(ids), k).tolist()
    return [(t, lp, top_id_rows[i] if i else [], top_lp_rows[i] if i else [])
            for i, (t, lp) in enumerate(zip(ids, lps, strict=True))]


def format_prompt_logprobs(prompt: PromptLogprobs, texts: TokenTexts) -> list[TokenLogprob]:
    """Every prompt token with its logprob (NaN for the first) and top alternatives, with texts."""
    return [format_logprobs(*row, texts) for row in prompt_rows(prompt)]


def format_logprobs(token_id: int, logprob: float, top_ids: list[int], top_lps: list[float],
                    texts: TokenTexts) -> TokenLogprob:
    """One token's logprob and top alternatives with each id's text, as the gateway sends them."""
    top = [TopLogprob(t, texts[t], lp) for t, lp in zip(top_ids, top_lps, strict=True)]
    return TokenLogprob(token_id, texts[token_id], logprob, top)
