"""`pipeserve bench structured`: what structured outputs cost the engine.

Step time: one batch of --batch requests decodes in process, either all free (the baseline) or with
every other row constrained by a JSON schema (an array of at least 64 objects with enums, integer
ranges, booleans and short strings, so no constrained row can end inside the window), its bitmask
filled on the fill thread (the CPU default) or on the step's thread after the forward pass (the CUDA
default). Free rows use ignore_eos, every row samples at temperature 1, and only steps that decode
the whole batch are timed. Runs alternate the three variants, --repeats of each; a variant's figure is
the median over runs of each run's median step time, its overhead that over the baseline's, minus 1.
Beside it, the time the step's own thread spent on constraints (MainThreadCost), which the load of
a shared machine disturbs far less.

Compile time: each schema (and a regex, a choice and an EBNF grammar) compiled cold, then again
(served from the engine's grammar cache). The engine builds its compiler (the tokenizer's vocabulary
read into a TokenizerInfo) while it loads the model; the first compile after start-up is reported
apart.

First request: time to first token of one request with a schema never seen before (the engine's
compiler ready, its grammar compiled while the request waits), of the next with the same schema
(from the cache), and of an unconstrained one, each alone on the idle engine.

The model is a ~18M Llama with random weights (float32) and a 512-token vocabulary, with the
stories260K tokenizer files copied beside it: constraints need a real vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.bench.report import machine_info, print_table, write_json
from pipeserve.bench.shapes import LLAMA_18M_V512, llama_18m_v512
from pipeserve.bench.workload import shared_dir

VARIANTS = ("free", "half constrained, fill thread", "half constrained, fill inline")

ITEM = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["kind", "age", "ok", "name"],
}
STEP_SCHEMA = {"type": "array", "items": ITEM, "minItems": 64}
COMPILE_CASES: dict[str, tuple[str, str]] = {
    "json_schema: array of objects": ("json_schema", json.dumps(STEP_SCHEMA)),
    "json_schema: nested, enums, ranges, patterns": (
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                    "score": {"type": "number", "minimum": -1, "maximum": 1},
                    "owner": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "pets": {"type": "array", "items": ITEM, "maxItems": 4},
                        },
                        "required": ["name"],
                    },
                },
                "required": ["id", "owner"],
            }
        ),
    ),
    "json_object": ("json_object", ""),
    "regex: e-mail": ("regex", r"[a-z]{1,12}@[a-z]{1,12}\.(com|org|net)"),
    "choice: 4 strings": ("choice", json.dumps(["yes", "no", "maybe", "ask again later"])),
    "grammar: arithmetic": (
        "grammar",
        'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= num | "(" expr ")"\nnum ::= [0-9]+',
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=32, help="decode batch (half constrained)")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens of every request")
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant, alternated")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is steadiest)")
    parser.add_argument(
        "--stories", default=None, help="stories260K dir (default: $PIPESERVE_SHARED/models/stories260K)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")


class MainThreadCost:
    """Wall time the step's own thread spends on constraints: starting the fill, waiting for it and
    uploading (`begin`, `mask`), masking the logits (`TokenMask.apply`) and advancing the matchers
    (`advance`). Less noisy than the step-time difference on a loaded machine."""

    def __init__(self, engine: Any) -> None:
        from pipeserve.engine.structured import TokenMask

        self.seconds = 0.0
        structured = engine.structured
        for name in ("begin", "mask", "advance"):
            setattr(structured, name, self._timed(getattr(structured, name)))
        TokenMask.apply = self._timed(TokenMask.apply)  # type: ignore[method-assign]

    def _timed(self, fn: Any) -> Any:
        def run(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return run


def timed_run(
    engine: Any,
    prompts: list[list[int]],
    steps: int,
    constrained: bool,
    seed: int,
    cost: MainThreadCost | None = None,
) -> tuple[float, float]:
    """Median ms of the steps that decode the whole batch (every row running, none prefilling), and
    the mean ms per such step the step's thread spent on constraints (when cost is given)."""
    from pipeserve.sampling_params import SamplingParams

    schema = json.dumps(STEP_SCHEMA)
    for i, prompt in enumerate(prompts):
        if constrained and i % 2:
            params = SamplingParams(max_tokens=steps + 1, temperature=1.0, seed=seed + i, json_schema=schema)
        else:
            params = SamplingParams(max_tokens=steps + 1, temperature=1.0, seed=seed + i, ignore_eos=True)
        engine.add(f"{'c' if constrained else 'f'}-{seed}-{i}", prompt, params)
    times, overhead = [], []
    while engine.has_work():
        running_before = engine.stats()["running"]
        spent = cost.seconds if cost else 0.0
        start = time.perf_counter()
        updates = engine.step()
        elapsed = time.perf_counter() - start
        decode_only = running_before == len(prompts) and len(updates) == len(prompts)
        if decode_only and not any(u.new for u in updates):
            times.append(elapsed)
            overhead.append((cost.seconds if cost else 0.0) - spent)
    if len(times) < steps // 2:
        raise RuntimeError(f"only {len(times)} full-batch decode steps were timed")
    return statistics.median(times) * 1e3, statistics.mean(overhead) * 1e3


def first_token_ms(engine: Any, rid: str, prompt: list[int], **constraint: Any) -> float:
    """Time to first token of one request on the idle engine."""
    from pipeserve.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0, **constraint))
    while not any(u.rid == rid and u.token_ids for u in engine.step()):
        pass
    first = time.perf_counter() - start
    while engine.has_work():
        engine.step()
    return first * 1e3


def first_request_ttft(engine: Any, prompt: list[int]) -> dict[str, float]:
    """TTFT of a request with a new schema, the same schema again, and no schema."""
    engine.structured.prepare().result()
    fresh = f"new_{time.time_ns()}"  # a property name no cache has seen
    schema = json.dumps({"type": "object", "required": [fresh, "kind"],
                         "properties": {fresh: {"type": "integer"}, "kind": {"enum": ["cat", "dog"]}}})
    return {
        "new_schema_ttft_ms": first_token_ms(engine, "new", prompt, json_schema=schema),
        "same_schema_ttft_ms": first_token_ms(engine, "same", prompt, json_schema=schema),
        "free_ttft_ms": first_token_ms(engine, "free", prompt),
    }


def compile_times(engine: Any) -> dict[str, Any]:
    structured = engine.structured
    start = time.perf_counter()
    structured.compile("regex", "x").result()  # the first compile after start-up
    first = time.perf_counter() - start
    rows = {}
    for name, (kind, text) in COMPILE_CASES.items():
        start = time.perf_counter()
        structured.compile(kind, text).result()
        cold = time.perf_counter() - start
        cached = []
        for _ in range(5):
            start = time.perf_counter()
            structured.compile(kind, text).result()
            cached.append(time.perf_counter() - start)
        rows[name] = {"cold_ms": cold * 1e3, "cached_us": statistics.median(cached) * 1e6}
    return {"first_compile_after_start_ms": first * 1e3, "grammars": rows}


def main(args: argparse.Namespace) -> int:
    import torch

    from pipeserve.engine.engine import Engine

    stories = Path(args.stories) if args.stories else shared_dir() / "models" / "stories260K"
    if not (stories / "tokenizer.json").is_file():
        raise SystemExit(f"pipeserve bench structured: no stories260K tokenizer at {stories}")
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    model_dir = llama_18m_v512(stories)
    engine = Engine(
        model=model_dir,
        device="cpu",
        dtype="float32",
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.batch * args.input_len,
        num_pages=args.batch * 16 + 16,
    )
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, LLAMA_18M_V512["vocab_size"], size=(args.batch, args.input_len)).tolist()
    compiles = compile_times(engine)
    ttft = first_request_ttft(engine, prompts[0])
    cost = MainThreadCost(engine)
    timed_run(engine, prompts, 8, constrained=True, seed=10_000, cost=cost)  # warm-up of both paths
    runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
    spent: dict[str, list[float]] = {name: [] for name in VARIANTS[1:]}
    for r in range(args.repeats):  # alternated, so drifting load hits every variant alike
        runs["free"].append(timed_run(engine, prompts, args.steps, constrained=False, seed=r * 1000)[0])
        for name, background in ((VARIANTS[1], True), (VARIANTS[2], False)):
            engine.structured.background_fill = background
            step_ms, thread_ms = timed_run(engine, prompts, args.steps, True, seed=r * 1000, cost=cost)
            runs[name].append(step_ms)
            spent[name].append(thread_ms)
    median = {name: statistics.median(times) for name, times in runs.items()}
    base_ms = median["free"]
    variants = {
        name: {
            "step_ms_runs": runs[name],
            "step_ms": median[name],
            "overhead_pct": (median[name] / base_ms - 1) * 100,
            **(
                {
                    "step_thread_constraint_ms_runs": spent[name],
                    "step_thread_constraint_ms": statistics.median(spent[name]),
                    "step_thread_constraint_pct": statistics.median(spent[name]) / base_ms * 100,
                }
                if name in spent
                else {}
            ),
        }
        for name in VARIANTS
    }
    result = {
        "bench": "structured",
        "machine": {**machine_info(), "load_average": {"start": load_start, "end": os.getloadavg()}},
        "model": {**engine.model_info(), "config": LLAMA_18M_V512, "tokenizer": "stories260K"},
        "config": {
            "batch": args.batch,
            "constrained_rows": args.batch // 2,
            "input_len": args.input_len,
            "steps": args.steps,
            "repeats": args.repeats,
            "threads": args.threads,
            "schema": STEP_SCHEMA,
        },
        "variants": variants,
        "target_overhead_pct": 5.0,
        "compile": compiles,
        "first_request": ttft,
    }
    print_table(
        f"decode step at batch {args.batch}: free, or {args.batch // 2} rows JSON-schema constrained "
        f"(median of {args.repeats} alternated runs)",
        ["variant", "ms/step", "overhead %", "constraint ms on the step's thread", "runs (ms/step)"],
        [
            [
                name,
                v["step_ms"],
                v["overhead_pct"],
                v.get("step_thread_constraint_ms", 0.0),
                " ".join(f"{t:.1f}" for t in runs[name]),
            ]
            for name, v in variants.items()
        ],
    )
    print(f"first compile after start-up: "
          f"{compiles['first_compile_after_start_ms']:.1f} ms")
    print(f"first token, alone on the idle engine: new schema {ttft['new_schema_ttft_ms']:.1f} ms, the same "
          f"schema again {ttft['same_schema_ttft_ms']:.1f} ms, no schema {ttft['free_ttft_ms']:.1f} ms")
    print_table(
        "grammar compile time",
        ["grammar", "cold ms", "cached us"],
        [[name, row["cold_ms"], row["cached_us"]] for name, row in compiles["grammars"].items()],
    )
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    engine.close()
    return 0
