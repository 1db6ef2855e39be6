"""`pipeserve bench step`: the cost of one decode step against the memory floor and two peers.

Same checkpoint, same token-id prompts, same torch/llama.cpp thread count, in one process, the
systems alternated in every repetition (medians reported):
- pipeserve with its step executors (EngineConfig.step_executor) and with eager steps, via LLM.generate;
- HF transformers `generate` (one batch of equal-length prompts, no padding waste);
- llama.cpp through llama-cpp-python on the checkpoint converted to GGUF f32 (batch 1 only; the
  optional `pipeserve[bench-llamacpp]` extra, skipped with the reason when it is not installed).
Every system generates exactly --new-tokens per prompt (EOS blocked), greedy; ms/step is the wall
time of the whole generate call over the number of decode steps (the short prefill included).

The memory floor: batch-1 decode must read every weight once per token, so floor = weight bytes /
the bandwidth a large fp32 matrix-vector product reaches here (measured in the same run, same
threads). Host overhead per step: pipeserve's step wall time less the CPU time inside torch
operators and compiled kernels, from torch.profiler over a few decode steps.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeserve.bench.report import Panel, Series, machine_info, plot_panels, print_table, write_json
from pipeserve.bench.shapes import LLAMA_18M_V512, llama_18m_v512
from pipeserve.bench.workload import BatchSizes, checkpoint, shared_dir
from pipeserve.config import cache_dir

# "pipeserve compiled" is the default (the native step for dense fp32 models); "pipeserve inductor"
# the same engine with the native step switched off, so that Inductor compiles the step.
# "pipeserve bf16" the default engine with the model in bf16 (weights and cache), not run by default.
SYSTEMS = ("pipeserve compiled", "pipeserve inductor", "pipeserve eager", "hf generate", "llama.cpp",
           "pipeserve bf16")
DEFAULT_SYSTEMS = SYSTEMS[:5]
LLAMA_CPP_VERSION = "0.3.36"  # the llama-cpp-python release whose converter this bench runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF checkpoint; default: the random ~18M Llama (vocab 512) built "
                        "in the cache dir with stories260K's tokenizer")
    parser.add_argument("--batch", "--batch-sizes", dest="batch", action=BatchSizes, default=[1, 8, 32],
                        help="batch sizes (--batch-sizes 1,8,32: the former spelling)")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=3, help="alternated repetitions (medians reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch and llama.cpp threads")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="comma-separated subset of: "
                        + ", ".join(SYSTEMS))
    parser.add_argument("--llama-cpp-src", help="an unpacked llama-cpp-python source package (its "
                        "vendored llama.cpp converts the checkpoint to GGUF); default: downloaded once "
                        "with pip into the cache dir")
    parser.add_argument("--profile-steps", type=int, default=16,
                        help="decode steps under torch.profiler (0: no profile)")
    parser.add_argument("--startup", action="store_true", help="instead: seconds to the first token of "
                        "LLM(stories260K) and `pipeserve up`, with an empty and then a warm compiler cache")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG: ms/step by batch size, floor marked")


# -- the memory floor ------------------------------------------------------------------------------
def gemv_bandwidth(megabytes: int = 256, repeats: int = 7) -> float:
    """GB/s of an fp32 matrix-vector product over a matrix far larger than the caches: the best of
    the repeats (what the memory system can deliver; other load only lowers it)."""
    n = int((megabytes * 2**20 / 4) ** 0.5)
    w, x = torch.randn(n, n), torch.randn(n)
    torch.mv(w, x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mv(w, x)
        times.append(time.perf_counter() - start)
    return w.numel() * 4 / min(times) / 1e9


def weight_bytes(model_dir: str) -> int:
    """Bytes a decode step reads: every matrix once (the embedding only as the LM head when tied;
    a row lookup otherwise)."""
    from safetensors import safe_open

    total, embed, tied_head = 0, 0, True
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            t = f.get_slice(name)
            size = int(np.prod(t.get_shape())) * 4
            if name.endswith("embed_tokens.weight"):
                embed = size
            else:
                total += size
            tied_head &= name != "lm_head.weight"
    return total + (embed if tied_head else 0)


# -- the systems ---------------------------------------------------------------------------------
Runner = Callable[[list[list[int]]], list[list[int]]]


def pipeserve_runner(model_dir: str, system: str, batch: int, new_tokens: int) -> tuple[Runner, Any]:
    from pipeserve.engine import LLM, SamplingParams

    executor = {"pipeserve eager": "eager", "pipeserve inductor": "compiled"}.get(system, "auto")
    dtype = "bfloat16" if system == "pipeserve bf16" else "float32"
    llm = LLM(model_dir, device="cpu", dtype=dtype, step_executor=executor, max_num_seqs=max(batch, 1),
              cpu_threads=torch.get_num_threads(), prefix_caching=False)
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    return run, llm


def hf_runner(model_dir: str, new_tokens: int) -> Runner:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(prompts: list[list[int]]) -> list[list[int]]:
        ids = torch.tensor(prompts)  # equal lengths: no padding
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    return run


def llama_cpp_source(given: str | None) -> Path:
    """The vendored llama.cpp of a llama-cpp-python source package: given, or fetched once with pip."""
    if given:
        root = Path(given)
    else:
        root = Path(cache_dir()) / f"llama-cpp-python-{LLAMA_CPP_VERSION}"
        if not root.is_dir():
            download = Path(cache_dir()) / "downloads"
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(download)], check=True)
            archive = next(download.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"))
            with tarfile.open(archive) as tar:
                tar.extractall(download, filter="data")
            shutil.move(download / f"llama_cpp_python-{LLAMA_CPP_VERSION}", root)
    vendored = root / "vendor" / "llama.cpp"
    if not (vendored / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"bench step: {vendored} has no convert_hf_to_gguf.py")
    return vendored


def to_gguf(model_dir: str, src: Path) -> str:
    """The checkpoint as GGUF f32 (converted once, beside the checkpoint)."""
    out = os.path.join(model_dir, "model-f32.gguf")
    if not os.path.isfile(out):
        env = os.environ | {"PYTHONPATH": str(src / "gguf-py")}
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), model_dir, "--outtype", "f32",
                        "--outfile", out], check=True, env=env, stdout=subprocess.DEVNULL)
    return out


def llama_cpp_runner(gguf: str, threads: int, context: int, new_tokens: int) -> Runner:
    from llama_cpp import Llama

    llm = Llama(gguf, n_threads=threads, n_threads_batch=threads, n_ctx=context, n_batch=context,
                verbose=False)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        outs = []
        for prompt in prompts:
            llm.reset()
            tokens: list[int] = []
            # top_k=1: greedy; the generator never stops on EOS itself, so every run has new_tokens.
            for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                tokens.append(token)
                if len(tokens) == new_tokens:
                    break
            outs.append(tokens)
        return outs

    return run


# -- host overhead -------------------------------------------------------------------------------
COMPUTE_PREFIXES = ("aten::", "mkl", "pipeserve::", "## Call CompiledFxGraph")


def host_overhead_ms(llm: Any, prompts: list[list[int]], steps: int) -> dict[str, float]:
    """Per decode step: wall ms, ms inside operators/compiled kernels, and the rest (host).

    A native step is one call the profiler does not see, and the profiler's own cost per operator
    would swamp the few operators around it: there the steps run unprofiled, the call is timed by
    the step itself, and host is everything outside it (the sampler's operators included)."""
    from torch.profiler import profile

    from pipeserve.engine import SamplingParams
    from pipeserve.engine.executor.native import NativeExecutor

    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 2, min_tokens=steps + 2, temperature=0.0)
    for i, p in enumerate(prompts):
        engine.add(f"profile-{i}", p, params)
    engine.step()  # the prefill step, not measured
    executor = engine.runner.executor
    native = executor.step if isinstance(executor, NativeExecutor) else None
    native_before = 0.0 if native is None else native.seconds
    recorder: Any = contextlib.nullcontext() if native is not None else profile()
    with recorder as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) / steps * 1e3
    native_ms = 0.0 if native is None else (native.seconds - native_before) * 1e3 / steps
    while engine.has_work():
        engine.step()
    if native is not None:
        compute = native_ms
    else:  # self times of operators, minus those nested in the compiled graph (already in its total)
        compute = sum(e.self_cpu_time_total for e in prof.key_averages()
                      if e.key.startswith(COMPUTE_PREFIXES)) / 1e3 / steps
    return {"step_ms": wall, "compute_ms": compute, "host_ms": max(wall - compute, 0.0)}


# -- start-up ------------------------------------------------------------------------------------
FIRST_TOKEN_LLM = """
import sys, time
start = time.perf_counter()
from pipeserve.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu")
llm.generate("Once upon a time", SamplingParams(max_tokens=1, temperature=0.0))
print(time.perf_counter() - start)
"""


def first_token_llm(model_dir: str, cache: str) -> float:
    """Seconds from a fresh interpreter to LLM(model)'s first token (imports included)."""
    env = os.environ | {"PIPESERVE_CACHE": cache}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", FIRST_TOKEN_LLM, model_dir], env=env, check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


def first_token_server(model_dir: str, cache: str) -> float:
    """Seconds from starting `pipeserve up` to the first token of a request sent once it is SERVING."""
    from pipeserve.local_cluster import LocalCluster

    env = {"PIPESERVE_CACHE": cache}
    start = time.perf_counter()
    with LocalCluster(Path(cache) / "up.log", model_dir, workers=1, startup=600.0, env=env) as cluster:
        for _ in cluster.client.stream("Once upon a time", max_tokens=1, temperature=0.0, timeout=60):
            break
        return time.perf_counter() - start


def startup(args: argparse.Namespace) -> int:
    import tempfile

    model_dir = checkpoint(args.model, "bench step")
    results: dict[str, Any] = {"model": model_dir}
    for name, measure in (("LLM", first_token_llm), ("pipeserve up", first_token_server)):
        with tempfile.TemporaryDirectory(prefix="pipeserve-cache-") as cache:
            cold = measure(model_dir, cache)
            results[name] = {"empty_cache_s": cold, "warm_cache_s": measure(model_dir, cache)}
    results |= {"machine": machine_info(), "loadavg": open("/proc/loadavg").read().split()[:3]}
    rows = [[name, results[name]["empty_cache_s"], results[name]["warm_cache_s"]]
            for name in ("LLM", "pipeserve up")]
    print_table("seconds to the first token (compile on)",
                ["", "empty compiler cache", "warm compiler cache"], rows)
    if args.json:
        write_json(args.json, results)
    return 0


# -- the run -------------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> int:
    if args.startup:
        return startup(args)
    torch.set_num_threads(args.threads)
    batches = list(args.batch)
    systems = [s.strip() for s in args.systems.split(",")]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"bench step: unknown systems {sorted(unknown)} (of {', '.join(SYSTEMS)})")
    if args.model:
        model_dir = checkpoint(args.model, "bench step")
    else:
        model_dir = llama_18m_v512(shared_dir() / "models" / "stories260K")
    vocab = int(__import__("json").load(open(os.path.join(model_dir, "config.json")))["vocab_size"])
    context = args.prompt_len + args.new_tokens + 8

    skipped: dict[str, str] = {}
    gguf = None
    if "llama.cpp" in systems:
        try:
            import llama_cpp  # noqa: F401

            gguf = to_gguf(model_dir, llama_cpp_source(args.llama_cpp_src))
        except ImportError:
            skipped["llama.cpp"] = ("llama-cpp-python is not installed: "
                                  "pip install 'pipeserve[bench-llamacpp]'")

    bandwidth = gemv_bandwidth()
    wbytes = weight_bytes(model_dir)
    results: dict[str, Any] = {"batches": {}}
    rng = np.random.default_rng(0)
    for batch in batches:
        runners: dict[str, Runner] = {}
        llms: dict[str, Any] = {}
        for system in systems:
            if system in skipped or (system == "llama.cpp" and batch != 1):
                continue
            if system.startswith("pipeserve"):
                runners[system], llms[system] = pipeserve_runner(model_dir, system, batch, args.new_tokens)
            elif system == "hf generate":
                runners[system] = hf_runner(model_dir, args.new_tokens)
            elif gguf is not None:
                runners[system] = llama_cpp_runner(gguf, args.threads, context, args.new_tokens)
        warm = rng.integers(3, vocab, size=(batch, args.prompt_len)).tolist()
        for run in runners.values():  # compiles, allocates, faults pages in: untimed
            run(warm)
        times: dict[str, list[float]] = {s: [] for s in runners}
        outputs: dict[str, list[list[int]]] = {}
        order = list(runners)
        for rep in range(args.repeats):
            prompts = rng.integers(3, vocab, size=(batch, args.prompt_len)).tolist()  # fresh each time
            for system in order[rep % len(order):] + order[: rep % len(order)]:
                start = time.perf_counter()
                outputs[system] = runners[system](prompts)
                times[system].append((time.perf_counter() - start) / args.new_tokens * 1e3)
        row: dict[str, Any] = {}
        for system, ts in times.items():
            ms = statistics.median(ts)
            row[system] = {"ms_per_step": ms, "tokens_per_s": batch * 1e3 / ms, "repeats_ms": ts}
        reference = outputs.get("pipeserve eager")
        if reference is not None:
            for system in ("pipeserve compiled", "pipeserve inductor", "hf generate", "llama.cpp"):
                if system in outputs:
                    row[system]["same_tokens_as_eager"] = outputs[system] == reference
        for system, llm in llms.items() if args.profile_steps else ():
            row[system]["profile"] = host_overhead_ms(llm, warm, args.profile_steps)
        results["batches"][str(batch)] = row
        del runners, llms

    floor_ms = wbytes / bandwidth / 1e6
    results |= {"model": model_dir, "config": LLAMA_18M_V512 if not args.model else None,
                "weight_bytes": wbytes, "gemv_GBps": bandwidth, "floor_ms_per_step": floor_ms,
                "threads": args.threads, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                "repeats": args.repeats, "skipped": skipped, "machine": machine_info(),
                "loadavg": open("/proc/loadavg").read().split()[:3]}
    rows = []
    for batch, row in results["batches"].items():
        hf = row.get("hf generate", {}).get("ms_per_step")
        for system, r in row.items():
            pct = floor_ms / r["ms_per_step"] * 100 if batch == "1" else None
            host = r.get("profile", {}).get("host_ms")
            rows.append([int(batch), system, r["ms_per_step"], r["tokens_per_s"], pct,
                         hf / r["ms_per_step"] if hf else None, host, r.get("same_tokens_as_eager")])
    print_table(f"decode steps (floor {floor_ms:.2f} ms/token at batch 1: {wbytes / 1e6:.1f} MB of weights "
                f"at {bandwidth:.1f} GB/s; {args.threads} thread(s))",
                ["batch", "system", "ms/step", "tok/s", "% of floor", "x HF", "host ms/step", "same tokens"],
                rows)
    for system, reason in skipped.items():
        print(f"{system}: skipped ({reason})")
    if args.json:
        write_json(args.json, results)
    if args.plot:
        panel = Panel("ms per decode step", xlabel="batch size", logx=True, title="bench step")
        for system in SYSTEMS:
            pts = [(int(b), r[system]["ms_per_step"]) for b, r in results["batches"].items() if system in r]
            if pts:
                panel.series.append(Series(system, [p[0] for p in pts], [p[1] for p in pts]))
        panel.series.append(Series("memory floor (batch 1)", [1], [floor_ms], marker="x", linestyle=""))
        plot_panels(args.plot, [panel])
    return 0
