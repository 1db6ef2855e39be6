"""Engine behaviour: aborts free everything, plain step updates, validation at the LLM edge (the
engine only asserts), seeds, loader errors, and the engine core's independence of the wire format."""

from __future__ import annotations

import ast
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeserve.engine.engine import Engine
from pipeserve.engine.llm import LLM
from pipeserve.engine.sequence import StepUpdate, TokenLogprobs
from pipeserve.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def drain(engine: Engine, limit: int = 10_000) -> dict[str, tuple[list[int], str]]:
    """Step until idle; rid -> (tokens, finish reason)."""
    out: dict[str, tuple[list[int], str]] = {}
    for _ in range(limit):
        if not engine.has_work():
            return out
        for update in engine.step():
            toks, reason = out.get(update.rid, ([], ""))
            out[update.rid] = (toks + update.token_ids, update.finish_reason or reason)
    raise AssertionError("engine did not go idle")


@pytest.fixture(scope="module", params=["off", "on"])
def llm(stories_dir, request) -> LLM:
    """Each test runs with synchronous steps and with overlapped steps (pipeserve/engine/engine.py)."""
    return LLM(stories_dir, device="cpu", page_size=4, num_pages=64, max_num_batched_tokens=12,
               overlap_steps=request.param)


@pytest.fixture(scope="module")
def engine(llm) -> Engine:
    return llm.engine


def test_abort_at_random_points_returns_every_page(engine):
    rng = random.Random(0)
    for trial in range(30):
        rids = [f"a{trial}-{i}" for i in range(4)]
        for rid in rids:
            engine.add(
                rid,
                [1] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))],
                SamplingParams(max_tokens=rng.randrange(1, 20), temperature=1.0),
            )
        victim = rng.choice(rids)
        for _ in range(rng.randrange(0, 8)):
            if engine.has_work():
                engine.step()
        engine.abort(victim)
        engine.abort(victim)  # idempotent
        results = drain(engine)
        assert results.get(victim, ([], "abort"))[1] in ("abort", "stop", "length")
    stats = engine.stats()
    assert stats["pages_used"] == 0 and stats["pages_reserved"] == 0
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["requests"] == 0


def test_abort_of_an_unknown_or_finished_request_is_a_no_op(engine):
    """Tombstones for aborts that overtake their add are the engine process's (test_pipeline_engine_loop)."""
    assert engine.abort("never-seen") is False
    engine.add("done", [1, 5, 6], SamplingParams(max_tokens=2))
    assert engine.abort("done") is True and engine.abort("done") is True  # idempotent
    assert drain(engine)["done"] == ([], "abort")
    assert engine.abort("done") is False and not engine.has_work()


def test_step_updates_are_plain_per_request_results(engine):
    engine.add("u", [1, 403, 407], SamplingParams(max_tokens=2, temperature=0.0, logprobs=3))
    engine.add("v", [1, 403], SamplingParams(max_tokens=3, temperature=0.0))
    first = engine.step()
    assert all(isinstance(u, StepUpdate) for u in first)
    assert [(u.rid, u.new, len(u.token_ids), u.finish_reason) for u in first] == [
        ("u", True, 1, ""), ("v", True, 1, "")]
    u, v = first
    assert u.seq.prompt_len == 3 and u.seq.params.logprobs == 3 and v.logprobs is None
    (lp,) = u.logprobs
    assert isinstance(lp, TokenLogprobs) and lp.top_ids.shape == (3,) and lp.top_logprobs.dtype == np.float32
    assert lp.top_ids[0] == u.token_ids[0]  # greedy: the sampled token is the top one
    assert lp.logprob == pytest.approx(float(lp.top_logprobs[0]), abs=1e-5)
    engine.abort("v")
    second = engine.step()  # the decode row first, then what ended between steps (no token)
    rows = [(x.rid, x.new, len(x.token_ids), x.finish_reason) for x in second]
    if engine.overlap:  # the decode step stays in flight: its token comes with the next call
        assert rows == [("v", False, 0, "abort")]
        rows = [(x.rid, x.new, len(x.token_ids), x.finish_reason) for x in engine.step()]
        assert rows == [("u", False, 1, "length")]
    else:
        assert rows == [("u", False, 1, "length"), ("v", False, 0, "abort")]
    assert not engine.has_work() and engine.requests == {}


def test_engine_asserts_instead_of_validating(engine):
    with pytest.raises(AssertionError):
        engine.add("bad", [], SamplingParams())
    with pytest.raises(AssertionError):
        engine.add("bad", [1, 10_000], SamplingParams())
    engine.add("dup", [1, 5], SamplingParams(max_tokens=3))
    with pytest.raises(AssertionError, match="already in flight"):
        engine.add("dup", [1, 5], SamplingParams(max_tokens=3))
    drain(engine)
    assert engine.requests == {}


@pytest.mark.parametrize(
    "params,prompt,match",
    [
        (dict(max_tokens=0), [1, 2], "max_tokens"),
        (dict(temperature=-1.0), [1, 2], "temperature"),
        (dict(temperature=float("nan")), [1, 2], "temperature"),
        (dict(top_p=0.0), [1, 2], "top_p"),
        (dict(top_p=1.5), [1, 2], "top_p"),
        (dict(top_k=0), [1, 2], "top_k"),
        (dict(top_k=-2), [1, 2], "top_k"),
        (dict(), [], "empty"),
        (dict(), [1, 10_000], "prompt_token_ids"),
        (dict(), [1] * 600, "context"),
    ],
)
def test_bad_requests_raise_at_the_llm_and_leave_the_engine_serving(llm, params, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 5], prompt], SamplingParams(**params))
    assert not llm.engine.has_work()  # validated up front: the good prompt was not added either
    (out,) = llm.generate([[1, 5]], SamplingParams(max_tokens=3, temperature=0.0))
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_seeded_sampling_is_independent_of_batch_composition(engine):
    params = dict(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    engine.add("alone", [1, 403, 407], SamplingParams(**params))
    alone = drain(engine)["alone"][0]
    for i in range(5):
        engine.add(f"noise{i}", [1, 20 + i, 30], SamplingParams(max_tokens=10 + i, temperature=1.0))
    engine.add("crowd", [1, 403, 407], SamplingParams(**params))
    assert drain(engine)["crowd"][0] == alone


def test_eos_stop_token_ids_min_tokens_ignore_eos(engine):
    # Greedy "Once upon a time" continues with "," (id found below); use it as a stop token.
    engine.add("probe", [1, 403, 407, 261, 378], SamplingParams(max_tokens=3, temperature=0.0))
    first = drain(engine)["probe"][0][0]
    engine.add(
        "stop",
        [1, 403, 407, 261, 378],
        SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[first]),
    )
    assert drain(engine)["stop"] == ([first], "stop")
    engine.add(
        "min",
        [1, 403, 407, 261, 378],
        SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[first], min_tokens=3),
    )
    toks, reason = drain(engine)["min"]
    assert len(toks) >= 3 and first not in toks[:3]
    engine.add("long", [1, 403], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    toks, reason = drain(engine)["long"]
    assert len(toks) == 200 and reason == "length"


def test_prompt_filling_the_pool_finishes_by_length(stories_dir):
    engine = Engine(model=stories_dir, device="cpu", page_size=4, num_pages=4)
    engine.add("big", [1] + [300] * 13, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    toks, reason = drain(engine)["big"]
    assert reason == "length" and 14 + len(toks) == 16
    assert engine.max_prompt_len == 15 and "KV cache" in (engine.capacity_problem(20) or "")


def test_llm_rejects_a_prompt_the_kv_pool_cannot_hold(stories_dir):
    llm = LLM(stories_dir, device="cpu", page_size=4, num_pages=4)
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate([[1] * 20])


def test_loader_rejects_unknown_architecture_and_bad_tensors(stories_dir, tmp_path):
    bad = tmp_path / "arch"
    shutil.copytree(stories_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        Engine(model=str(bad), device="cpu")

    from safetensors.torch import load_file, save_file

    missing = tmp_path / "missing"
    shutil.copytree(stories_dir, missing)
    weights = load_file(str(missing / "model.safetensors"))
    save_file(
        {k: v for k, v in weights.items() if "layers.3.mlp.up_proj" not in k},
        str(missing / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="lacks tensors"):
        Engine(model=str(missing), device="cpu")

    shaped = tmp_path / "shaped"
    shutil.copytree(stories_dir, shaped)
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, str(shaped / "model.safetensors"))
    with pytest.raises(ValueError, match="shape"):
        Engine(model=str(shaped), device="cpu")


def test_sharded_checkpoint_loads(stories_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = load_file(f"{stories_dir}/model.safetensors")
    names = sorted(weights)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for f in ("config.json", "generation_config.json"):
        shutil.copy(f"{stories_dir}/{f}", tmp_path / f)
    for fname, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(tmp_path / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = Engine(model=str(tmp_path), device="cpu")
    single = Engine(model=stories_dir, device="cpu")
    for eng in (sharded, single):
        eng.add("x", [1, 403, 407], SamplingParams(max_tokens=8, temperature=0.0))
    assert drain(sharded)["x"] == drain(single)["x"]


def test_demo_model_is_built_and_serves():
    engine = Engine(device="cpu", num_pages=32)
    assert engine.model_info()["name"].startswith("pipeserve-demo")
    engine.add("d", engine.tokenizer("hello").input_ids, SamplingParams(max_tokens=4, temperature=0.0))
    assert len(drain(engine)["d"][0]) == 4


def test_last_layer_for_sampled_rows_only_matches_the_full_forward(stories_dir):
    """With meta.sample_rows the model returns just those rows, its last layer run as decoding for
    them: the same hidden states as the full forward's rows (a step mixing decode rows, whole
    prompts and a partial chunk, which has no sampled row)."""
    import dataclasses

    eng = Engine(model=stories_dir, device="cpu", page_size=4, num_pages=64, max_num_batched_tokens=40)
    eng.add("d", list(range(5, 25)), SamplingParams(max_tokens=8, temperature=0.0))
    eng.step()  # "d" decodes from now on
    eng.add("p", list(range(30, 43)), SamplingParams(max_tokens=4, temperature=0.0))
    eng.add("long", list(range(50, 120)), SamplingParams(max_tokens=4, temperature=0.0))
    batch = eng.scheduler.schedule()
    assert batch.decode and len(batch.prefill) == 2 and batch.prefill_lens[-1] < 70  # chunked
    runner = eng.runner
    flat = runner.build(batch)
    meta = runner.eager.metadata(flat)
    ids, pos = torch.as_tensor(flat.input_ids), torch.as_tensor(flat.positions)
    full = eng.model(ids, pos, dataclasses.replace(meta, sample_rows=None), eng.pool.layers)
    rows = meta.sample_rows
    assert rows.tolist() == [0, 1 + 13 - 1]  # the decode row, the end of "p"; not the partial chunk
    sampled = eng.model(ids, pos, meta, eng.pool.layers)
    torch.testing.assert_close(sampled, full.index_select(0, rows), atol=1e-5, rtol=1e-5)


ENGINE_CORE = ["pipeserve/engine/engine.py", "pipeserve/engine/scheduler.py", "pipeserve/engine/runner.py",
               "pipeserve/engine/sampler.py", "pipeserve/engine/sequence.py"]


def _imports(path: Path) -> set[str]:
    """Every module a file imports (absolute names; relative ones resolved against its package)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return names


def test_the_engine_core_does_not_know_the_wire_format():
    files = [REPO / f for f in ENGINE_CORE]
    for folder in ("pipeserve/engine/kv", "pipeserve/engine/model", "pipeserve/engine/parallel",
                   "pipeserve/engine/spec"):
        files += sorted((REPO / folder).rglob("*.py"))
    assert len(files) > len(ENGINE_CORE)
    for path in files:
        wire = {name for name in _imports(path) if name == "pipeserve.messages" or name.startswith(
            ("pipeserve.messages.", "msgpack", "zmq"))}
        assert not wire, f"{path.relative_to(REPO)} imports {sorted(wire)}"
