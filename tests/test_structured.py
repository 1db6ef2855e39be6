"""Structured outputs: constraint validation at every edge, the grammar cache, the sampler's mask,
and the engine on stories260K (a model that never writes JSON by itself) sampling at temperature 1:
every output that finishes with `stop` matches its constraint; free rows are untouched by
constrained neighbours; matcher state survives preemption and chunked prefill; a slow compilation
holds back only its own request."""

from __future__ import annotations

import ast
import json
import re
import threading
from concurrent.futures import Future

import jsonschema
import numpy as np
import pytest
import torch

from pipeserve.engine.engine import Engine
from pipeserve.engine.llm import LLM
from pipeserve.engine.sampler import Sampler
from pipeserve.engine.structured import TokenMask
from pipeserve.grammar import build_grammar, check_constraint
from pipeserve.messages import EngineRequest, TokenizeRequest, decode, encode
from pipeserve.sampling_params import SamplingParams
from pipeserve.tokenizer.load import load_tokenizer
from pipeserve.tokenizer.worker import Tokenizer
from tests.conftest import TEST_DEVICE

SCHEMAS = {
    "nested-enums-ranges-optional": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 1, "maximum": 120},
            "mood": {"enum": ["happy", "sad", "calm"]},
            "pet": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["cat", "dog"]},
                    "legs": {"type": "integer", "minimum": 2, "maximum": 4},
                },
                "required": ["kind"],
            },
        },
        "required": ["name", "age", "mood"],
    },
    "bounded-arrays-numbers": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 5},
                "minItems": 1,
                "maxItems": 3,
            },
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        },
        "required": ["tags", "score"],
    },
    "string-patterns": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "ok": {"type": "boolean"},
            "note": {"type": ["string", "null"], "maxLength": 8},
        },
        "required": ["id", "ok"],
    },
}
REGEX = r"[a-z]{1,8}@[a-z]{1,6}\.(com|org)"
CHOICES = ["yes", "no", "maybe later", "never"]
ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" expr ")"
num ::= "0" | [1-9] [0-9]?
"""
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # a JSON string literal
PROMPTS = ["Once upon a time", "The answer is", "Lily said", "Tom went to the park and"]


def accepts(grammar, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    return bool(_is_grammar_accept_string(grammar, text))


def is_json_prefix(text: str) -> bool:
    """Whether text is a prefix of some JSON document, as Python's own decoder sees it: the decoder
    runs out of input (rather than meeting a wrong character) once an open string is closed and a
    cut number or literal completed."""
    for _ in range(4):
        try:
            json.loads(text)
            return True
        except json.JSONDecodeError as exc:
            rest = text[exc.pos :]
            if exc.pos >= len(text) or any(word.startswith(rest) for word in ("true", "false", "null")):
                return True
            if exc.msg.startswith("Unterminated string"):
                text = re.sub(r"\\(u[0-9a-fA-F]{0,3})?$", "", text) + '"'
            elif re.fullmatch(r"[0-9.eE+-]+", rest):
                text += "0"
            else:
                return False
    return False


def is_arithmetic(text: str) -> bool:
    """Parses as an expression of integers, + - * / and parentheses (never evaluated)."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    return all(isinstance(n, allowed) for n in ast.walk(tree))


@pytest.fixture(scope="module")
def llm(stories_dir) -> LLM:
    return LLM(stories_dir, device=TEST_DEVICE, max_num_batched_tokens=256)


def sample_many(llm: LLM, n: int, max_tokens: int, **constraint) -> list:
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, **constraint) for seed in range(n)
    ]
    return llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(n)], params)


# -- validation at the edges ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(json_schema={"type": "object"}, regex="a"), "at most one"),
        (dict(choice=[]), "choice must be a non-empty list"),
        (dict(choice=["a", ""]), "choice strings must be non-empty"),
        (dict(json_schema="{not json"), "json_schema is not valid JSON"),
        (dict(json_schema="[1, 2]"), "json_schema must be a JSON object"),
        (dict(regex=""), "regex must be a non-empty string"),
        (dict(grammar=""), "grammar must be a non-empty string"),
        (dict(json_object=True, ignore_eos=True), "cannot be combined"),
        (dict(regex="a+", min_tokens=3), "cannot be combined"),
    ],
)
def test_sampling_params_refuse_malformed_constraints(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields).validate()


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            dict(json_schema={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
            "json_schema is invalid",
        ),
        (dict(json_schema={"type": "object", "required": 5}), "json_schema is invalid"),
        (dict(regex="(ab"), "regex is invalid"),
        (dict(regex="a{3,1}"), "regex is invalid"),
        (dict(grammar='root ::= "a" |'), "grammar is invalid"),
        (dict(grammar='start ::= "a"'), "grammar is invalid"),  # no root rule
    ],
)
def test_constraints_that_do_not_build_are_refused_with_the_reason(fields, match):
    params = SamplingParams(**fields)
    params.validate()  # well-formed: only building the grammar finds the problem
    with pytest.raises(ValueError, match=match) as info:
        check_constraint(params)
    assert len(str(info.value)) > len(match) + 2  # xgrammar's reason follows


def test_every_constraint_kind_builds_and_json_is_compact():
    for kind, text in [
        ("json_schema", json.dumps(SCHEMAS["string-patterns"])),
        ("json_object", ""),
        ("regex", REGEX),
        ("choice", json.dumps(['say "hi"\n', "naïve", "a|b"])),
        ("grammar", ARITHMETIC),
    ]:
        build_grammar(kind, text)
    # Compact JSON: no whitespace anywhere between tokens, nested values included.
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "boolean"}}},
        "required": ["a", "b"],
    }
    typed, anything = build_grammar("json_schema", json.dumps(schema)), build_grammar("json_object", "")
    for grammar in (typed, anything):
        assert accepts(grammar, '{"a":1,"b":[true,false]}')
        assert not accepts(grammar, '{"a": 1,"b":[true,false]}') and not accepts(
            grammar, '{"a":1,"b":[true, false]}'
        )
    assert accepts(anything, '{"x":{"y":[null,"s",-1.5e3,{}]}}') and not accepts(anything, "[1]")
    assert not accepts(typed, '{"a":1,"b":[],"c":2}')  # strict: only the declared properties


def test_constraint_canonical_form_keeps_schema_key_order():
    a = SamplingParams(json_schema={"properties": {"x": {}, "y": {}}, "type": "object"})
    b = SamplingParams(json_schema=json.dumps({"properties": {"x": {}, "y": {}}, "type": "object"}))
    c = SamplingParams(json_schema={"properties": {"y": {}, "x": {}}, "type": "object"})
    assert a.constraint() == b.constraint() != c.constraint()
    assert SamplingParams(choice=["a", "b"]).constraint() == ("choice", '["a", "b"]')
    assert SamplingParams().constraint() is None and SamplingParams(json_object=False).constraint() is None


def test_constraints_cross_the_wire():
    params = SamplingParams(
        json_schema={"type": "object", "properties": {"n": {"type": "number", "maximum": 1.5}}}
    )
    msg = decode(encode(EngineRequest("r", b"\x01\x00\x00\x00", params)))
    assert isinstance(msg, EngineRequest) and msg.sampling == params
    for fields in (
        dict(choice=["a", "b"]),
        dict(regex="x+"),
        dict(json_object=True),
        dict(grammar='root ::= "a"'),
    ):
        sent = TokenizeRequest("r", SamplingParams(**fields), prompt="hi")
        assert decode(encode(sent)) == sent


@pytest.mark.device
def test_a_constraint_that_does_not_compile_is_refused_by_the_engine(stories_dir):
    """The tokenizer worker forwards it (it never imports xgrammar); the engine's compilation refuses
    it with the reason, before it is scheduled, and the batch goes on."""
    worker = Tokenizer(load_tokenizer(stories_dir), 512)
    out = worker.handle(TokenizeRequest("r1", SamplingParams(regex="(unclosed"), prompt="hi"))
    assert out.TAG == "request"
    engine = Engine(model=stories_dir, device=TEST_DEVICE, num_pages=64)
    ids = engine.tokenizer("Once upon a time").input_ids
    engine.add("bad", ids, SamplingParams(max_tokens=4, regex="(unclosed"))
    engine.add("ok", ids, SamplingParams(max_tokens=4, temperature=0.0))
    ends: dict[str, tuple[str | None, int]] = {}
    refused: dict[str, str] = {}
    while engine.has_work():
        for u in engine.step():
            if u.finish_reason:
                ends[u.rid] = (u.finish_reason, len(u.seq.token_ids) - u.seq.prompt_len)
        refused |= engine.take_refused()
    assert ends == {"bad": ("abort", 0), "ok": ("length", 4)}
    assert list(refused) == ["bad"] and refused["bad"].startswith("regex is invalid")
    assert engine.take_refused() == {}
    engine.close()


@pytest.mark.device
def test_llm_refuses_bad_constraints_before_any_engine_work(llm):
    before = llm.engine.step_count
    with pytest.raises(ValueError, match="grammar is invalid"):
        llm.generate(["hi", "there"], [SamplingParams(), SamplingParams(grammar="root ::= (")])
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        llm.generate("hi", SamplingParams(choice=[]))
    assert llm.engine.step_count == before and not llm.engine.has_work()
    assert llm.generate("hi", SamplingParams(max_tokens=3, choice=["ok"]))[0].text == "ok"


# -- the sampler's mask -----------------------------------------------------------------------------


@pytest.mark.device
def test_mask_applies_to_its_rows_only_and_logprobs_stay_raw():
    vocab = 70  # not a multiple of 32: the last bitmask word is partial
    sampler = Sampler(4, vocab, torch.device(TEST_DEVICE), max_logprobs=3)
    for slot in range(3):
        sampler.set_request(slot, SamplingParams(temperature=0.0, logprobs=2), [1], [], [])
    logits = torch.randn(3, vocab)
    raw = logits.clone()
    bitmask = torch.zeros(3, 3, dtype=torch.int32)
    allowed = [5, 40, 69]  # one token in each word
    for t in allowed:
        bitmask[1, t // 32] |= 1 << (t % 32)
    out = sampler.sample(logits, np.arange(3), torch.arange(3), TokenMask([1], bitmask))
    assert torch.equal(logits, raw)  # the float32 logits were not masked in place
    expected = raw.argmax(-1)
    expected[1] = max(allowed, key=lambda t: raw[1, t].item())
    assert out.tokens.tolist() == expected.tolist()
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs, torch.log_softmax(raw, -1).gather(1, out.tokens[:, None]).squeeze(1))


@pytest.mark.device
def test_mask_comes_before_temperature_and_top_p():
    """A constrained row samples only allowed tokens at any temperature and top-p, even when the
    allowed tokens are far outside the unconstrained top-p nucleus."""
    vocab = 64
    sampler = Sampler(1, vocab, torch.device(TEST_DEVICE))
    sampler.set_request(0, SamplingParams(temperature=2.0, top_p=0.5, seed=3), [1], [], [])
    logits = torch.zeros(1, vocab)
    logits[0, :8] = 20.0  # the whole nucleus
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 1] = (1 << 3) | (1 << 9)  # tokens 35 and 41
    seen = {
        sampler.sample(
            logits, np.zeros(1, np.int64), torch.zeros(1, dtype=torch.int64), TokenMask([0], bitmask)
        ).tokens.item()
        for _ in range(40)
    }
    assert seen == {35, 41}


@pytest.mark.device
def test_grammars_are_cached_by_content_and_compiled_once(stories_dir):
    engine = Engine(model=stories_dir, device=TEST_DEVICE, num_pages=64)
    structured = engine.structured
    first = structured.compile("regex", "[ab]+")
    again = structured.compile("regex", "[ab]+")  # while the first may still be compiling
    other = structured.compile("regex", "[ab]*")
    assert first is again and other is not first
    assert first.result(30) is again.result(30)


# -- the engine, end to end -------------------------------------------------------------------------


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate_at_temperature_one(llm, name):
    schema = SCHEMAS[name]
    outs = sample_many(llm, 24, 200, json_schema=schema)
    llm.engine.structured.background_fill = False  # the fill on this thread, as on CUDA: same outputs
    try:
        again = sample_many(llm, 4, 200, json_schema=schema)
    finally:
        llm.engine.structured.background_fill = True
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:4]]
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= len(outs) // 2, [o.finish_reason for o in outs]
    for out in finished:
        value = json.loads(out.text)
        jsonschema.validate(value, schema)
        assert not re.search(r"\s", STRING.sub('""', out.text)), (
            out.text
        )  # compact: no whitespace outside strings
    for out in outs:
        if out.finish_reason == "length":  # cut mid-structure: a prefix, never free text
            assert out.text.startswith("{") and is_json_prefix(out.text), out.text


@pytest.mark.device
def test_json_object_outputs_are_compact_objects(llm):
    """stories260K opens a key string and tells a story in it, never reaching `}` within the budget:
    what it writes must still be a compact JSON object cut short."""
    outs = sample_many(llm, 8, 48, json_object=True)
    for out in outs:
        assert out.text.startswith("{") and is_json_prefix(out.text), out.text
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
    assert not is_json_prefix('{"a":1}x') and not is_json_prefix('{"a" 1') and is_json_prefix('{"a":[tr')


@pytest.mark.device
def test_regex_choice_and_grammar_outputs_match(llm):
    outs = sample_many(llm, 16, 40, regex=REGEX)
    assert all(o.finish_reason == "stop" and re.fullmatch(REGEX, o.text) for o in outs), [
        o.text for o in outs
    ]

    outs = sample_many(llm, 16, 20, choice=CHOICES)
    assert all(o.finish_reason == "stop" and o.text in CHOICES for o in outs)
    assert len({o.text for o in outs}) > 1  # temperature 1 explores the choices

    outs = sample_many(llm, 24, 48, grammar=ARITHMETIC)
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped and all(is_arithmetic(o.text) for o in stopped), [o.text for o in stopped]


@pytest.mark.device
@pytest.mark.parametrize("background_fill", [True, False], ids=["fill-thread", "fill-inline"])
def test_free_rows_in_mixed_batches_get_exactly_their_solo_tokens(stories_dir, background_fill):
    llm = LLM(stories_dir, device=TEST_DEVICE)
    llm.engine.structured.background_fill = background_fill
    free = SamplingParams(max_tokens=24, temperature=0.0)
    alone = [o.token_ids for o in llm.generate(PROMPTS, free)]
    constrained = [
        SamplingParams(max_tokens=24, temperature=1.0, seed=1, json_schema=SCHEMAS["string-patterns"]),
        SamplingParams(max_tokens=24, temperature=0.0, regex=REGEX),
        SamplingParams(max_tokens=24, temperature=1.0, seed=2, choice=CHOICES),
        SamplingParams(max_tokens=24, temperature=0.0, grammar=ARITHMETIC),
    ]
    prompts = [p for pair in zip(PROMPTS, PROMPTS, strict=True) for p in pair]  # free, constrained, ...
    params = [p for pair in zip([free] * 4, constrained, strict=True) for p in pair]
    mixed = llm.generate(prompts, params)
    assert [o.token_ids for o in mixed[0::2]] == alone
    assert re.fullmatch(REGEX, mixed[3].text) and mixed[5].text in CHOICES


@pytest.mark.device
@pytest.mark.slow
def test_matcher_state_survives_preemption_and_chunked_prefill(stories_dir):
    prompts = [p + " and then" for p in PROMPTS] + ["One day a little"]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, json_schema=SCHEMAS["nested-enums-ranges-optional"]),
        SamplingParams(max_tokens=40, temperature=0.0, grammar=ARITHMETIC),
    ] * 2 + [SamplingParams(max_tokens=40, temperature=0.0, regex=REGEX)]
    roomy = LLM(stories_dir, device=TEST_DEVICE, dtype="float32")
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    # 14 pages of 4 tokens cannot hold five ~45-token requests: the engine preempts (recompute).
    tight = LLM(stories_dir, device=TEST_DEVICE, dtype="float32", page_size=4, num_pages=14)
    assert [o.token_ids for o in tight.generate(prompts, params)] == expected
    assert tight.engine.stats()["preemptions"] > 0 and not tight.engine.structured.matchers
    chunked = LLM(stories_dir, device=TEST_DEVICE, dtype="float32", max_num_batched_tokens=3)
    outs = chunked.generate(prompts, params)
    assert re.fullmatch(REGEX, outs[4].text) or outs[4].finish_reason == "length"
    for out in outs[0::2][:2]:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMAS["nested-enums-ranges-optional"])


@pytest.mark.device
def test_a_slow_compilation_holds_back_only_its_own_request(stories_dir, monkeypatch):
    engine = Engine(model=stories_dir, device=TEST_DEVICE, num_pages=64)
    gate = threading.Event()
    original = engine.structured.compile

    def slow_compile(kind: str, text: str, after: str | None = None):
        future = original(kind, text, after)
        held: Future = Future()
        threading.Thread(
            target=lambda: (gate.wait(30), held.set_result(future.result())), daemon=True
        ).start()
        return held

    monkeypatch.setattr(engine.structured, "compile", slow_compile)
    ids = engine.tokenizer("Once upon a time").input_ids
    engine.add("json", ids, SamplingParams(max_tokens=8, temperature=0.0, json_object=True))
    engine.add("free", ids, SamplingParams(max_tokens=8, temperature=0.0))
    tokens: dict[str, list[int]] = {"json": [], "free": []}
    finished: dict[str, str] = {}
    while "free" not in finished:
        for update in engine.step():
            tokens[update.rid] += update.token_ids
            finished.update({update.rid: update.finish_reason} if update.finish_reason else {})
    assert len(tokens["free"]) == 8 and not tokens["json"]  # the batch ran; the grammar was not ready
    stats = engine.stats()
    assert engine.has_work() and stats["waiting"] == 0 and stats["compiling"] == 1  # outside the scheduler
    gate.set()
    while engine.has_work():
        for update in engine.step():
            tokens[update.rid] += update.token_ids
    text = engine.tokenizer.decode(tokens["json"])
    assert text.startswith("{") and len(tokens["json"]) <= 8


@pytest.mark.device
def test_abort_while_compiling_and_a_failed_compilation_end_only_that_request(stories_dir, monkeypatch):
    engine = Engine(model=stories_dir, device=TEST_DEVICE, num_pages=64)
    ids = engine.tokenizer("Once upon a time").input_ids
    gate = threading.Event()
    blocked = engine.structured._compile_pool.submit(gate.wait, 30)  # noqa: F841  (occupies a compile thread)
    blocked2 = engine.structured._compile_pool.submit(gate.wait, 30)  # noqa: F841
    engine.add("a", ids, SamplingParams(max_tokens=4, regex="x+"))
    assert engine.abort("a")
    updates = engine.step()
    assert [(u.rid, u.finish_reason, u.token_ids) for u in updates] == [("a", "abort", [])]
    assert not engine.has_work()
    gate.set()

    def broken(kind: str, text: str, after: str | None = None) -> Future:
        future: Future = Future()
        future.set_exception(RuntimeError("out of memory"))
        return future

    monkeypatch.setattr(engine.structured, "compile", broken)
    engine.add("b", ids, SamplingParams(max_tokens=4, regex="y+"))
    engine.add("c", ids, SamplingParams(max_tokens=4, temperature=0.0))
    seen: dict[str, str] = {}
    while engine.has_work():
        for u in engine.step():
            if u.finish_reason:
                seen[u.rid] = u.finish_reason
    assert seen == {"b": "abort", "c": "length"}


@pytest.mark.device
def test_ids_past_the_tokenizer_vocabulary_are_never_allowed(tiny_model):
    """A random model with 320 logits over a 259-token byte-level tokenizer: the ids past the
    tokenizer are never allowed, and outputs still match."""
    llm = LLM(tiny_model("llama"), device=TEST_DEVICE)
    assert llm.engine.model_config.vocab_size > len(llm.tokenizer)
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, regex="[a-c]{2,4}!") for s in range(8)]
    for out in llm.generate(["hello"] * 8, params):
        assert out.finish_reason == "stop" and re.fullmatch("[a-c]{2,4}!", out.text), out.text
        assert max(out.token_ids) < len(llm.tokenizer)
