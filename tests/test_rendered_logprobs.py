"""The detokenizer renders OpenAI logprobs as JSON pieces and the HTTP front end splices them: the
bytes must be exactly what building OpenAI's objects and json.dumps-ing them gives (the reference
below is how the gateway rendered them before), however the entries are cut into deltas."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeserve.detokenizer.openai_logprobs import CHAT, COMPLETION, Renderer
from pipeserve.gateway.rendered_json import Logprobs, Raw, dumps
from pipeserve.messages import LogprobsJSON, TextDeltas, TokenLogprob, TopLogprob, decode, encode, pack_ids


def reference_completion(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets, position = [], offset
    for e in entries:
        offsets.append(position)
        position += len(e.token)
    none = [math.isnan(e.logprob) for e in entries]
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [None if n else e.logprob for n, e in zip(none, entries, strict=True)],
            "top_logprobs": [None if n else {t.token: t.logprob for t in e.top}
                             for n, e in zip(none, entries, strict=True)],
            "text_offset": offsets}


def reference_chat(entries: list[TokenLogprob]) -> dict[str, Any]:
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [one(e.token, e.logprob) | {"top_logprobs": [one(t.token, t.logprob) for t in e.top]}
                        for e in entries]}


def reference_dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


# Texts with what JSON escapes, non-ASCII, an empty one, and two ids sharing a text (a dict keeps one key).
TEXTS = {0: "<s>", 1: " Once", 2: "\"q\"\\", 3: "é中", 4: "", 5: "\n\t\x01", 6: " Once", 7: "🙂", 8: "a"}
floats = st.one_of(st.floats(width=32, allow_nan=False), st.sampled_from([-math.inf, 0.0, -0.0, -1e-30]))
# A top table may hold any float32 (NaN and infinities are written by name, as json.dumps does).
top_floats = st.one_of(floats, st.sampled_from([math.nan, math.inf]))
token_ids = st.sampled_from(sorted(TEXTS))


@st.composite
def entries(draw: Any) -> list[TokenLogprob]:
    out = []
    for i in range(draw(st.integers(0, 6))):
        top = [TopLogprob(t, TEXTS[t], draw(top_floats)) for t in draw(st.lists(token_ids, max_size=5))]
        first_prompt = i == 0 and draw(st.booleans())  # the echoed first prompt token: NaN, no top
        token = draw(token_ids)
        out.append(TokenLogprob(token, TEXTS[token], math.nan if first_prompt else draw(floats),
                                [] if first_prompt else top))
    return out


def rendered(entries: list[TokenLogprob], fmt: str, cuts: list[int]) -> Logprobs:
    """The entries rendered by the detokenizer in deltas cut at cuts, through the wire, joined."""
    renderer = Renderer(TEXTS)  # type: ignore[arg-type]  # an id -> text mapping
    bounds = sorted({0, len(entries), *[c for c in cuts if 0 < c < len(entries)]})
    pieces = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        row = renderer.pieces(fmt)
        for e in entries[a:b]:
            top = e.top
            renderer.add(row, fmt, e.token_id, e.logprob, [t.token_id for t in top], [t.logprob for t in top])
        message = TextDeltas(["r"], [""], pack_ids([]), [0, 0], [""], [0], [0], [0],
                             logprobs_json=[row.message()])
        wire = decode(encode(message))
        assert isinstance(wire, TextDeltas) and wire.logprobs_json is not None
        pieces.append(wire.logprobs_json[0])
    return Logprobs(pieces)


@settings(max_examples=300, deadline=None)
@given(entries(), st.integers(0, 50), st.lists(st.integers(0, 6), max_size=3))
def test_completion_logprobs_are_byte_exact(entries: list[TokenLogprob], offset: int,
                                            cuts: list[int]) -> None:
    got = dumps({"index": 0, "text": "x", "logprobs": rendered(entries, COMPLETION, cuts).completion(offset),
                 "finish_reason": None})
    want = reference_dumps({"index": 0, "text": "x", "logprobs": reference_completion(entries, offset),
                            "finish_reason": None})
    assert got == want


@settings(max_examples=300, deadline=None)
@given(entries(), st.lists(st.integers(0, 6), max_size=3))
def test_chat_logprobs_are_byte_exact(entries: list[TokenLogprob], cuts: list[int]) -> None:
    got = dumps({"delta": {"content": "x"}, "logprobs": rendered(entries, CHAT, cuts).chat()})
    want = reference_dumps({"delta": {"content": "x"}, "logprobs": reference_chat(entries)})
    assert got == want


def test_prompt_and_generated_entries_join_in_order() -> None:
    prompt = [TokenLogprob(0, "<s>", math.nan),
              TokenLogprob(1, " Once", -0.5, [TopLogprob(1, " Once", -0.5)])]
    generated = [TokenLogprob(8, "a", -1.25, [TopLogprob(8, "a", -1.25), TopLogprob(3, "é中", -2.0)])]
    joined = rendered(prompt, COMPLETION, []) + Logprobs() + rendered(generated, COMPLETION, [])
    assert joined.count == 3
    assert dumps(joined.completion(0)) == reference_dumps(reference_completion(prompt + generated, 0))


def test_client_text_cannot_forge_a_splice() -> None:
    """Strings that look like anything (the marker's shape included) stay strings; Raws land in order."""
    tricky = ["\x00", "\x00raw\x00", '"logprobs":', "\\u0000"]
    payload = {"choices": [{"text": t, "logprobs": Raw(f"[{i}]")} for i, t in enumerate(tricky)]}
    want = {"choices": [{"text": t, "logprobs": [i]} for i, t in enumerate(tricky)]}
    assert json.loads(dumps(payload)) == want
    with pytest.raises(TypeError):
        dumps({"x": object()})


def test_empty_rows_carry_nothing() -> None:
    empty = LogprobsJSON(["", "", ""], pack_ids([]))
    assert not Logprobs([empty, None])
    assert dumps(Logprobs([empty]).completion(7)) == reference_dumps(reference_completion([], 7))
    assert dumps(Logprobs().chat()) == reference_dumps(reference_chat([]))


def test_a_chunk_event_is_its_payload_as_sse_writes_it() -> None:
    """A stream event joins the call's head, written once, with each choice: byte for byte what
    sse() of the merged payload writes, in both kinds of call, spliced logprobs included."""
    from pipeserve.gateway.openai_api import Call, sse

    for chat in (False, True):
        call = Call(chat, "m\u00e9\"", [], 1, True, rid="cmpl-1")
        for text in ("", "x\u4e2d\n", '"q"'):
            choice = {"index": 3, "text": text, "logprobs": Raw('{"tokens":["a"]}'), "finish_reason": None}
            assert call.chunk_event(choice) == sse(call.head(True) | {"choices": [choice]})
