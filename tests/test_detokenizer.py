"""The incremental detokenizer (property tests against the full decode), the stop-string matcher,
the detokenizer's step -> deltas logic, and the detokenizer process over real ZeroMQ sockets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeserve.detokenizer.incremental import (
    FFFD,
    HOLD_TOKENS,
    MAX_CONTEXT,
    Delta,
    IncrementalDetokenizer,
    RequestText,
    StopMatcher,
    make_decoder,
    skipped_ids,
)
from pipeserve.detokenizer.openai_logprobs import Renderer
from pipeserve.detokenizer.worker import Detokenizer, Row
from pipeserve.engine.process import step_logprobs
from pipeserve.engine.sequence import TokenLogprobs
from pipeserve.messages import (
    PROMPT_TAIL,
    Abort,
    DetokenizeRequest,
    MessageError,
    NewRequestInfo,
    PromptLogprobs,
    StepLogprobs,
    StepOutput,
    TextDeltas,
    TokenLogprob,
    TopLogprob,
    decode,
    encode,
    pack_floats,
    pack_ids,
    unpack_ids,
)
from pipeserve.sampling_params import SamplingParams
from pipeserve.tokenizer.load import load_tokenizer
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)
PROPERTY = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
CHARS = "中文日本語한국어😀🎉👍🏽🙂éüßЖ…"  # 2, 3 and 4 UTF-8 bytes each
NEVER_VALID = [*range(0x80, 0xC0), *range(0xF8, 0x100)]  # bytes no UTF-8 character starts with
LEADS = list(range(0xC2, 0xF5))


@pytest.fixture(scope="module")
def stories(stories_dir: str):
    return load_tokenizer(stories_dir)


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE tokenizer (GPT-2 style, lossy UTF-8 decode) trained here on a tiny corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["Once upon a time there was a little girl named Lily. 她喜欢在公园里玩。 🙂😀🎉 naïve café",
              "日本語のテキストと中文文本, emoji 👍🏽 and ümlauts über alles"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def units(tok, invalid: bool) -> st.SearchStrategy[list[int]]:
    """stories260K id sequences built from whole pieces: words, multi-byte characters spelled in
    byte-fallback tokens, special tokens and (optionally) runs of bytes that are not UTF-8, fenced
    by words (ByteFallback decodes a whole byte run at once, so the fences define the full decode)."""
    vocab = tok.get_vocab()
    byte = {b: vocab[f"<0x{b:02X}>"] for b in range(256)}
    word = st.sampled_from(sorted(i for t, i in vocab.items() if not t.startswith("<"))).map(lambda i: [i])
    char = st.sampled_from(CHARS).map(lambda c: [byte[b] for b in c.encode()])
    special = st.sampled_from(sorted(skipped_ids(tok))).map(lambda i: [i])
    options = [word, word, char, char, special]
    if invalid:
        bad = st.tuples(word, st.lists(st.sampled_from(NEVER_VALID), max_size=10),
                        st.lists(st.sampled_from(LEADS), max_size=1), word)
        options.append(bad.map(lambda t: t[0] + [byte[b] for b in t[1] + t[2]] + t[3]))
    return st.lists(st.one_of(options), max_size=14).map(lambda us: [i for u in us for i in u])


def reference(tok, prompt: list[int], out: list[int], skip: bool) -> str:
    """The output's text in the full decode: decode(prompt + out) after decode(prompt)."""
    before = tok.decode(prompt, skip_special_tokens=skip)
    full = tok.decode(prompt + out, skip_special_tokens=skip)
    assert full.startswith(before)
    return full[len(before):]


def stream(tok, prompt: list[int], out: list[int], skip: bool, chunks: list[int],
           stops: list[str] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, prompt, stops, skip)
    deltas, i = [], 0
    for size in chunks + [1] * len(out):
        if i >= len(out):
            break
        delta = d.add(out[i:i + size])
        deltas.append(delta.text)
        i += size
        assert delta.stopped == d.stopped
        if delta.stopped:
            break
        held = d.stop.held  # held back only while it may still become a stop string
        assert not held or any(s.startswith(held) and s != held for s in stops)
        assert d.held_tokens < 2 * HOLD_TOKENS  # a U+FFFD is held a bounded number of tokens
        assert len(d.ids) <= MAX_CONTEXT + 2 * HOLD_TOKENS  # the window stays short
    deltas.append(d.flush())
    return deltas, d


def check_replacements(deltas: list[str], expected: str) -> None:
    """No delta holds U+FFFD unless the full decode has one at that spot."""
    at = 0
    for delta in deltas:
        for j, ch in enumerate(delta):
            if ch == FFFD:
                assert expected[at + j: at + j + 1] == FFFD, (deltas, expected)
        at += len(delta)


def first_stop(text: str, stops: list[str]) -> str:
    """text cut before the stop string that completes first (earliest end; ties: the longest)."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return text[: min(hits)[1]] if hits else text


CHUNKS = st.lists(st.integers(1, 3), max_size=40)


def test_skipped_prompt_ids_do_not_crowd_out_the_context(stories) -> None:
    """A prompt ending in skipped special ids: the context is the last MAX_CONTEXT kept ids, so a
    4-byte character before them stays whole instead of leaving stray continuation bytes."""
    prompt = [243, 162, 155, 131] + [stories.unk_token_id] * (MAX_CONTEXT - 3)  # U+1F600, <unk>s
    out = [231, 187, 176]  # U+4E2D in three byte tokens
    deltas, _ = stream(stories, prompt, out, True, [])
    assert "".join(deltas) == reference(stories, prompt, out, True) == "\u4e2d"


@PROPERTY
@given(data=st.data(), skip=st.booleans(), chunks=CHUNKS)
def test_stories_utf8_streams_exactly(stories, data, skip: bool, chunks: list[int]) -> None:
    prompt, out = data.draw(units(stories, False)), data.draw(units(stories, False))
    deltas, _ = stream(stories, prompt, out, skip, chunks)
    expected = reference(stories, prompt, out, skip)
    assert "".join(deltas) == expected
    assert not any(FFFD in d for d in deltas)


@PROPERTY
@given(data=st.data(), skip=st.booleans(), chunks=CHUNKS)
def test_stories_invalid_bytes_stream_exactly(stories, data, skip: bool, chunks: list[int]) -> None:
    prompt, out = data.draw(units(stories, True)), data.draw(units(stories, True))
    deltas, _ = stream(stories, prompt, out, skip, chunks)
    expected = reference(stories, prompt, out, skip)
    assert "".join(deltas) == expected
    check_replacements(deltas, expected)


PROMPTS = st.sampled_from(["", "Once upon a time", "她喜欢", "🙂 hi", "café 😀"])


@PROPERTY
@given(prompt=PROMPTS, bos=st.booleans(), out=st.lists(st.integers(0, 399), max_size=40), skip=st.booleans(),
       chunks=CHUNKS)
def test_byte_level_random_ids_stream_exactly(bpe, prompt: str, bos: bool, out: list[int], skip: bool,
                                              chunks: list[int]) -> None:
    """Any ids at all (a lossy UTF-8 decoder makes the full decode local, so it is always reachable)."""
    out = [i % len(bpe) for i in out]
    ids = bpe.encode(prompt, add_special_tokens=bos)
    deltas, _ = stream(bpe, ids, out, skip, chunks)
    expected = reference(bpe, ids, out, skip)
    assert "".join(deltas) == expected
    check_replacements(deltas, expected)


@PROPERTY
@given(data=st.data(), which=st.sampled_from(["stories", "bpe"]), chunks=CHUNKS)
def test_stop_strings_cut_before_first_match(stories, bpe, data, which: str, chunks: list[int]) -> None:
    if which == "stories":
        tok, prompt, out = stories, data.draw(units(stories, True)), data.draw(units(stories, True))
    else:
        tok = bpe
        prompt = bpe.encode(data.draw(PROMPTS))
        out = data.draw(st.lists(st.integers(0, len(bpe) - 1), max_size=40))
    text = reference(tok, prompt, out, True)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if text and data.draw(st.booleans()):  # a piece of the text, so matches do happen
            at = data.draw(st.integers(0, len(text) - 1))
            stops.append(text[at: at + data.draw(st.integers(1, 6))])
        else:
            stops.append(data.draw(st.sampled_from(["the", "中", "😀", "a b", " Lily.", FFFD])))
    deltas, d = stream(tok, prompt, out, True, chunks, stops)
    assert "".join(deltas) == first_stop(text, stops)
    assert d.stopped == any(s in text for s in stops)


def test_emoji_and_cjk_byte_by_byte(stories) -> None:
    prompt = stories.encode("Lily saw")
    out = stories.encode("😀 and 中", add_special_tokens=False)  # "▁😀 and 中"
    assert len(out) >= 9  # spelled in byte-fallback tokens
    d = IncrementalDetokenizer(stories, prompt)
    deltas = [d.add(t).text for t in out] + [d.flush()]
    assert "".join(deltas) == " 😀 and 中"
    assert "😀" in deltas and "中" in deltas  # each released whole, by the token that completes it
    assert not any(FFFD in x for x in deltas)


def test_replacement_char_hold_is_bounded(stories) -> None:
    lone = stories.convert_tokens_to_ids("<0x80>")  # a continuation byte: always invalid
    d = IncrementalDetokenizer(stories, stories.encode("Lily"))
    deltas = [d.add(lone).text for _ in range(3 * HOLD_TOKENS)]
    assert "".join(deltas[: HOLD_TOKENS - 1]) == ""  # might still be half a character
    assert "".join(deltas).count(FFFD) >= 2 * HOLD_TOKENS  # then released, not held to the end
    assert "".join(deltas) + d.flush() == FFFD * 3 * HOLD_TOKENS


def test_prompt_tail_cut_mid_character(stories) -> None:
    """The engine sends only the prompt's tail; a character it cuts must not garble the output."""
    prompt = stories.encode("She said 中中中中")  # the last 8 ids start inside a 中
    assert FFFD in stories.decode(prompt[-MAX_CONTEXT:])
    out = stories.encode(" to Lily", add_special_tokens=False)[1:]  # "▁to", ...: no lone "▁"
    d = IncrementalDetokenizer(stories, prompt[-MAX_CONTEXT:])
    assert "".join(d.add(t).text for t in out) + d.flush() == " to Lily"


def test_stop_string_across_token_boundaries(stories) -> None:
    prompt = stories.encode("Once upon a time")
    there, was = stories.encode(" there was", add_special_tokens=False)[-2:]
    d = IncrementalDetokenizer(stories, prompt, ["re wa"])
    first = d.add(there)
    assert (first.text, first.stopped, d.stop.held) == (" the", False, "re")  # "re" may start the stop
    second = d.add(was)
    assert (second.text, second.stopped) == ("", True)  # nothing of "re wa" leaks
    assert d.add(there) == Delta("", True) and d.flush() == ""


def test_stop_matcher_holds_minimal_suffix() -> None:
    m = StopMatcher(["hello", "abcd", "bc"])
    assert m.feed("say hel") == "say " and m.held == "hel"
    assert m.feed("p me") == "help me" and m.held == ""
    assert m.feed("xa") == "x" and m.held == "a"  # "a" may become "abcd"
    assert m.feed("bc") == "a" and m.stopped  # "bc" completes first: generation stops there
    assert m.feed("more") == "" and m.flush() == ""
    m = StopMatcher(["The end"])
    assert m.feed("It was The") == "It was " and m.flush() == "The"  # at the end it is just text
    assert StopMatcher([]).feed("anything") == "anything"


def test_skip_special_tokens_false_keeps_them(stories) -> None:
    out = stories.encode("Lily", add_special_tokens=False) + [stories.eos_token_id]  # "▁Lily"
    d = IncrementalDetokenizer(stories, stories.encode("Hi"), skip_special_tokens=False)
    assert "".join(d.add(t).text for t in out) + d.flush() == " Lily</s>"
    d = IncrementalDetokenizer(stories, stories.encode("Hi"))
    assert "".join(d.add(t).text for t in out) + d.flush() == " Lily"


def test_tokens_that_decode_to_nothing_cost_constant_time(stories) -> None:
    """sglang #13275: a window that grows with empty tokens makes each decode longer (quadratic)."""
    eos, space = stories.eos_token_id, stories.convert_tokens_to_ids("▁")
    the = stories.convert_tokens_to_ids("▁the")
    decode, decoded = make_decoder(stories), []

    def counted(ids, skip):
        decoded.append(len(ids))
        return decode(ids, skip)

    d = IncrementalDetokenizer(stories, stories.encode("Once"), decode=counted)
    before = len(decoded)
    for _ in range(20000):
        assert d.add(eos).text == ""
        assert len(d.ids) <= MAX_CONTEXT
    assert len(decoded) == before  # skipped ids never reach the decoder
    assert d.add(the).text == " the"
    assert max(decoded) <= MAX_CONTEXT + 1  # and no decode ever grows with them
    d = IncrementalDetokenizer(stories, [])  # no context: "▁" decodes to "" only by stripping
    out = [space] * 2000 + [the]
    text = "".join(d.add(t).text for t in out) + d.flush()
    assert text == stories.decode(out) and len(d.ids) <= 2


def test_in_process_api(stories) -> None:
    """What LLM.generate uses: ids one at a time (or several), Delta(text, stopped), flush()."""
    prompt = stories.encode("Once upon a time")
    out = stories.encode(", there was a little girl named Lily.", add_special_tokens=False)[1:]
    d = IncrementalDetokenizer(stories, prompt, ["girl"], True)
    text = ""
    for t in out:
        delta = d.add(t)
        text += delta.text
        if delta.stopped:
            break
    assert (text, d.stopped) == (", there was a little ", True)
    d = IncrementalDetokenizer(stories, prompt)
    assert d.add(out).text + d.flush() == ", there was a little girl named Lily."


def test_request_text_is_the_one_stop_abort_flush_path(stories) -> None:
    prompt = stories.encode("Once upon a time")
    out = stories.encode(", there was a little girl named Lily.", add_special_tokens=False)[1:]
    text = RequestText(IncrementalDetokenizer(stories, prompt, ["girl"]))
    got = []
    for t in out:
        got.append(text.feed([t]))
        if text.finished:
            break
    assert "".join(u.text for u in got) == ", there was a little "
    assert [u.abort for u in got] == [False] * (len(got) - 1) + [True] and got[-1].finish == "stop"
    assert text.completion_tokens == len(got) < len(out)  # the id that completed the stop string counts
    text = RequestText(IncrementalDetokenizer(stories, prompt, ["Lily."]))  # the engine ended it first
    updates = [text.feed([t], "length" if i == len(out) - 1 else "") for i, t in enumerate(out)]
    assert updates[-1].finish == "stop" and not any(u.abort for u in updates)
    text = RequestText(IncrementalDetokenizer(stories, prompt, ["Lily"]))
    assert text.feed(out[:3]).text + text.feed([], "abort").text == ", there was"  # flushed at the end
    assert text.finish == "abort"


def test_llm_generate_and_the_detokenizer_process_give_the_same_text(stories_dir, stories) -> None:
    """Both ends of the pipeline drive RequestText: the offline LLM from the engine's updates, the
    detokenizer from their wire form. Stop strings (within and across tokens) and random byte-fallback
    output (UTF-8 held and released) come out identical, finish reasons and token ids too."""
    from pipeserve.engine.llm import LLM
    from pipeserve.engine.process import step_output

    llm = LLM(stories_dir, device="cpu", num_pages=64, max_num_seqs=8)
    prompts = ["Once upon a time", "Lily and Tom", "One day", "The cat"]
    params = [SamplingParams(max_tokens=30, temperature=0.0, stop=["little"]),
              SamplingParams(max_tokens=30, temperature=0.0, stop=["re wa", "ed "]),
              SamplingParams(max_tokens=40, temperature=3.0, seed=7, skip_special_tokens=False),
              SamplingParams(max_tokens=40, temperature=3.0, seed=11, stop=["\ufffd", "a"])]
    offline = llm.generate(prompts, params)

    engine, det = llm.engine, Detokenizer(stories)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        ids = stories(prompt).input_ids
        engine.add(f"w{i}", ids, SamplingParams.from_dict(p.to_dict()))
        tail = pack_ids(ids[-PROMPT_TAIL:])
        told_ = DetokenizeRequest([f"w{i}"], len(ids), tail, p.stop, p.skip_special_tokens)
        det.settings(decode(encode(told_)), {})
    text: dict[str, str] = {}
    ids: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    while engine.has_work():
        rows: dict[str, Row] = {}
        wire = decode(encode(step_output(engine.step_count + 1, engine.step())))
        for _, rid in det.process(wire, rows):
            engine.abort(rid, "stop")
        deltas = det.deltas(rows)
        for r, rid in enumerate(deltas.rids):
            text[rid] = text.get(rid, "") + deltas.text[r]
            ids.setdefault(rid, []).extend(unpack_ids(deltas.tokens)[deltas.offsets[r]:deltas.offsets[r + 1]])
            finish[rid] = deltas.finish[r]
    served = [(text[f"w{i}"], finish[f"w{i}"], [int(t) for t in ids[f"w{i}"]]) for i in range(len(prompts))]
    assert served == [(o.text, o.finish_reason, o.token_ids) for o in offline]
    assert [o.finish_reason for o in offline][:2] == ["stop", "stop"]
    assert any(FFFD in o.text or o.finish_reason == "stop" for o in offline[2:])


# -- the detokenizer's step -> deltas logic (no sockets) ----------------------------------------

def told(rid: str, tok, prompt: str, **kw) -> DetokenizeRequest:
    """What the tokenizer tells the detokenizer of a request (through the wire format)."""
    ids = tok.encode(prompt)
    return decode(encode(DetokenizeRequest([rid], len(ids), pack_ids(ids[-PROMPT_TAIL:]), **kw)))


def new(rid: str, **kw) -> NewRequestInfo:
    """What the engine says of a request with its first step."""
    return NewRequestInfo(rid, **kw)


def step(n: int, rows: list[tuple[str, int, str]], new_: list[NewRequestInfo] = (),
         logprobs: list[TokenLogprobs | None] | StepLogprobs | None = None) -> StepOutput:
    """A step's output; logprobs per row become the wire's columns as the engine packs them."""
    if isinstance(logprobs, list):
        logprobs = step_logprobs(logprobs)
    return StepOutput(n, [r for r, _, _ in rows], pack_ids([t for _, t, _ in rows]), [f for _, _, f in rows],
                      list(new_), logprobs)


def row_logprobs(logprob: float, top: list[tuple[int, float]]) -> TokenLogprobs:
    return TokenLogprobs(logprob, np.array([t for t, _ in top], dtype=np.int64),
                         np.array([lp for _, lp in top], dtype=np.float32))


def run_steps(det: Detokenizer, *msgs: StepOutput | DetokenizeRequest) -> tuple[TextDeltas, list[str]]:
    rows: dict[str, Row] = {}
    stopped = [rid for m in msgs for _, rid in det.handle(m, rows)]
    return decode(encode(det.deltas(rows))), stopped  # through the wire format


def test_deltas_batch_rows_usage_and_state_lifetime(stories) -> None:
    det = Detokenizer(stories)
    a = stories.encode(" there was", add_special_tokens=False)[-2:]
    b = stories.encode(" Lily", add_special_tokens=False)[-1:]
    msg, stopped = run_steps(det, told("a", stories, "Once upon a time"), told("b", stories, "Hi"),
                             step(1, [("a", a[0], ""), ("b", b[0], "")],
                                  [new("a"), new("b", cached_prompt_tokens=1)]),
                             step(2, [("a", a[1], ""), ("b", stories.eos_token_id, "stop")]))
    assert stopped == [] and msg.rids == ["a", "b"]  # one row per request per message
    assert msg.text == [" there was", " Lily"] and msg.finish == ["", "stop"]
    assert [unpack_ids(msg.tokens)[msg.offsets[i]:msg.offsets[i + 1]].tolist() for i in range(2)] == \
        [a, b + [stories.eos_token_id]]
    assert msg.prompt_tokens == [len(stories.encode("Once upon a time")), len(stories.encode("Hi"))]
    assert msg.completion_tokens == [2, 2] and msg.logprobs is None and msg.cached_prompt_tokens == [0, 1]
    assert msg.stats == {"detok_requests": 1}
    msg, _ = run_steps(det, step(3, [("a", -1, "abort")]))  # aborted: no token, just the end
    assert (msg.rids, msg.text, msg.finish, msg.completion_tokens) == (["a"], [""], ["abort"], [2])
    assert msg.stats["detok_requests"] == 0 and det.requests == {}


def test_stop_string_aborts_engine_once(stories) -> None:
    det = Detokenizer(stories)
    ids = stories.encode(" there was a girl", add_special_tokens=False)[1:]
    info = told("s", stories, "Once upon a time", stop=["re wa"])
    steps = [step(i + 1, [("s", t, "")], [new("s")] if i == 0 else []) for i, t in enumerate(ids)]
    msg, stopped = run_steps(det, info, *steps)
    assert stopped == ["s"] and msg.text == [" the"] and msg.finish == ["stop"]
    assert msg.completion_tokens == [2]  # the token that completed the stop counts; later ones never arrive
    msg, stopped = run_steps(det, step(9, [("s", ids[-1], "")]))  # the engine had not seen the abort yet
    assert stopped == [] and msg.rids == [] and msg.stats["detok_requests"] == 0
    det = Detokenizer(stories)  # stop string on the request's last token: the engine ended it already
    msg, stopped = run_steps(det, info, step(1, [("s", ids[0], "")], [new("s")]),
                             step(2, [("s", ids[1], "length")]))
    assert stopped == [] and msg.finish == ["stop"]


def test_heartbeat_is_forwarded(stories) -> None:
    det = Detokenizer(stories)
    msg, _ = run_steps(det, step(0, []))
    assert msg.rids == [] and msg.stats == {"detok_requests": 0}  # engine counters: their own heartbeat


def test_output_before_its_settings_waits_for_them(stories) -> None:
    """The settings (from the tokenizer) and the first step (from the engine) come through different
    pipes: a first step that wins the race is held, then fed when the settings come."""
    det = Detokenizer(stories)
    a = stories.encode(" there was", add_special_tokens=False)[-2:]
    msg, _ = run_steps(det, step(1, [("a", a[0], "")], [new("a", cached_prompt_tokens=3)]),
                       step(2, [("a", a[1], "")]), step(2, [("stale", 5, "")]))
    assert msg.rids == [] and list(det.early) == ["a"]  # "stale" (no first step seen): dropped
    msg, _ = run_steps(det, told("a", stories, "Once upon a time"), step(3, [("a", -1, "length")]))
    assert (msg.rids, msg.text, msg.finish) == (["a"], [" there was"], ["length"])
    assert msg.cached_prompt_tokens == [3]
    assert det.early == {} and det.requests == {}


def test_an_abort_before_the_first_step_reaches_the_gateway(stories) -> None:
    """A request aborted while it waited in the engine ends with no first step: its finish still
    reaches the gateway (which frees the id on it)."""
    det = Detokenizer(stories)
    msg, _ = run_steps(det, told("w", stories, "Hi"), step(1, [("w", -1, "abort")]))
    assert (msg.rids, msg.finish, msg.completion_tokens) == (["w"], ["abort"], [0]) and det.requests == {}


def test_logprobs_carry_token_text(stories) -> None:
    det = Detokenizer(stories)
    there, lily = stories.convert_tokens_to_ids(["▁there", "▁Lily"])
    row = row_logprobs(-0.5, [(there, -0.5), (lily, -1.5)])
    msg, _ = run_steps(det, told("a", stories, "Hi", logprobs=True), told("b", stories, "Hi"),
                       step(1, [("a", there, ""), ("b", lily, "")], [new("a"), new("b")], [row, None]))
    assert msg.logprobs == [[TokenLogprob(there, " there", -0.5, [TopLogprob(there, " there", -0.5),
                                                                  TopLogprob(lily, " Lily", -1.5)])], None]


def test_openai_formats_render_the_same_entries(stories) -> None:
    """A request submitted with an OpenAI logprobs format gets its logprobs (and prompt logprobs)
    rendered: the same entries the gRPC path carries, as that format's JSON pieces."""
    there, lily = stories.convert_tokens_to_ids(["▁there", "▁Lily"])
    row = row_logprobs(-0.5, [(there, -0.5), (lily, -1.5)])
    prompt_ids = stories.encode("Hi")
    lps = [float("nan")] + [-2.0] * (len(prompt_ids) - 1)
    prompt = PromptLogprobs(pack_ids(prompt_ids), pack_floats(lps), pack_ids([lily] * len(prompt_ids)),
                            pack_floats([-3.0] * len(prompt_ids)))
    for fmt in ("completion", "chat", "bogus"):
        det = Detokenizer(stories)
        msg, _ = run_steps(det, told("a", stories, "Hi", logprobs=True, logprobs_format=fmt),
                           step(1, [("a", there, "")], [new("a", prompt_logprobs=prompt)], [row]))
        plain = Detokenizer(stories)
        want, _ = run_steps(plain, told("a", stories, "Hi", logprobs=True),
                            step(1, [("a", there, "")], [new("a", prompt_logprobs=prompt)], [row]))
        if fmt == "bogus":  # an unknown format: entries, as gRPC gets them
            assert msg.logprobs == want.logprobs and msg.logprobs_json is None
            continue
        assert msg.logprobs is None and msg.prompt_logprobs is None
        renderer = Renderer(det.texts)
        for got, entries in ((msg.logprobs_json[0], want.logprobs[0]),
                             (msg.prompt_logprobs_json[0], want.prompt_logprobs[0])):
            pieces = renderer.pieces(fmt)
            for e in entries:
                renderer.add(pieces, fmt, e.token_id, e.logprob, [t.token_id for t in e.top],
                             [t.logprob for t in e.top])
            assert got == pieces.message()
        assert '" there"' in msg.logprobs_json[0].parts[0]


def test_malformed_steps_and_restart(stories) -> None:
    det = Detokenizer(stories)
    with pytest.raises(MessageError):
        det.process(StepOutput(1, ["a"], pack_ids([5, 6]), [""]), {})
    wire = msgpack.unpackb(encode(step(1, [("a", 300, "")], [new("a")])))
    wire["new"][0]["cached_prompt_tokens"] = "x"  # a nested field of the wrong type: the step is refused
    with pytest.raises(MessageError, match=r"step.new\[0\].cached_prompt_tokens"):
        decode(msgpack.packb(wire))
    bad = DetokenizeRequest(["a"], 3, b"\x01\x02\x03")  # packed ids of 3 bytes
    msg, _ = run_steps(det, bad, told("b", stories, "Hi"), step(1, [("a", 300, "")], [new("a"), new("b")]))
    assert msg.rids == [] and list(det.requests) == ["b"]  # bad settings dropped: a's row waits for good ones
    assert list(det.early) == ["a"]
    bad = StepLogprobs(pack_floats([1.0]), pack_ids([2]), pack_ids([1, 2]), pack_floats([0.5]))
    msg, _ = run_steps(det, step(2, [("b", 300, "")], logprobs=bad))
    assert msg.text and msg.logprobs is None  # malformed logprobs are dropped; the step's tokens stand
    # Step numbers went back: a new engine. b (it ran on the old one) is gone; c, whose settings came
    # for the new one, stays.
    run_steps(det, told("c", stories, "Hi"), step(1, [], [new("c")]))
    assert list(det.requests) == ["c"]


def test_restart_drops_the_dead_engines_queued_requests(stories) -> None:
    """A request the dead engine held but never started leaves no state: the new engine's first
    message (its idle heartbeat) drops it, and the gateway's abort of it, should its add reach the new
    engine, ends nothing held for settings that will not come again."""
    det = Detokenizer(stories)
    run_steps(det, told("a", stories, "Hi"), told("q", stories, "Hi"), step(5, [("a", 300, "")], [new("a")]))
    assert list(det.requests) == ["a", "q"]  # q queued in the engine, not started yet
    run_steps(det, step(0, []))  # the new engine's heartbeat
    assert not det.requests
    run_steps(det, step(1, [("q", 0, "abort")], [new("q")]))  # its add and abort, queued during the restart
    assert not det.requests and not det.early and not det.gone


# -- the process ------------------------------------------------------------------------------

@pytest.fixture
def detok_process(stories_dir: str, tmp_path):
    addr = {name: f"ipc://{tmp_path}/{name}" for name in ("steps", "deltas", "control")}
    ctx = zmq.Context()
    deltas, control, steps = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    deltas.bind(addr["deltas"])
    control.bind(addr["control"])
    steps.connect(addr["steps"])
    proc = subprocess.Popen([sys.executable, "-m", "pipeserve.cli", "detokenizer", "--model", stories_dir,
                             *[f"--{k}={v}" for k, v in addr.items()]], cwd=REPO,
                            env=os.environ | {"PYTHONPATH": str(REPO)})
    try:
        yield proc, steps, deltas, control
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)


def recv(sock: zmq.Socket, timeout_s: float = 10.0):
    assert sock.poll(int(timeout_s * 1000)), "nothing arrived"
    return decode(sock.recv())


def test_process_streams_batches_and_stops(detok_process, stories) -> None:
    proc, steps, deltas, control = detok_process
    deadline = time.monotonic() + 30
    while not deltas.poll(200):  # heartbeats until the process is up
        assert proc.poll() is None and time.monotonic() < deadline
        steps.send(encode(step(0, [])))
    msg = recv(deltas)
    assert msg.stats == {"detok_requests": 0}
    while deltas.poll(200):
        deltas.recv()

    steps.send(b"\x93garbage")  # malformed: logged and dropped
    steps.send(msgpack.packb({"v": 1, "t": "step", "step": "x"}))
    ids = stories.encode(", there was a little girl named Lily.", add_special_tokens=False)[1:]
    prompt = "Once upon a time"
    infos = [new("plain"), new("stop")]
    os.kill(proc.pid, signal.SIGSTOP)  # let the steps queue up: one receive must fold them all
    try:
        steps.send(encode(told("plain", stories, prompt)))  # as a tokenizer sends them
        steps.send(encode(told("stop", stories, prompt, stop=["girl"])))
        for i, t in enumerate(ids):
            steps.send(encode(step(i + 1, [("plain", t, ""), ("stop", t, "")], infos if i == 0 else [])))
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    expected = {"plain": ", there was a little girl named Lily.", "stop": ", there was a little "}
    text: dict[str, str] = {}
    finish: dict[str, str] = {}
    msgs = 0
    while text != expected:
        m = recv(deltas)
        msgs += 1
        for rid, t, f in zip(m.rids, m.text, m.finish, strict=True):
            text[rid] = text.get(rid, "") + t
            finish[rid] = f
    assert msgs < len(ids)  # batched per receive, not one message per step
    assert finish == {"plain": "", "stop": "stop"}
    abort = recv(control)
    assert isinstance(abort, Abort) and abort.rids == ["stop"] and abort.reason == "stop"
    steps.send(encode(step(100, [("plain", 5, "length")])))
    assert recv(deltas).finish == ["length"]
    steps.send(encode(step(100, [])))
    assert recv(deltas).stats["detok_requests"] == 0  # nothing leaked
    assert proc.poll() is None
