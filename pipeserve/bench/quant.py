"""`pipeserve bench quant`: what each quantization configuration costs in accuracy and buys in memory
and speed, against the unquantized model in the same run.

CPU section (always; the shared stories260K by default, torch backend), per configuration:
  ppl, ppl_delta_pct: teacher-forced perplexity on a generated children's-story text (quant/eval.py)
      through the engine's model and a paged KV cache of the configuration's dtype, and its change;
  logits_rel_err: relative RMS error of every position's logits against the unquantized model's;
  greedy_agreement: share of greedy tokens (LLM.generate, --greedy-tokens per prompt) equal to the
      unquantized model's at the same position;
  weight_mib: every weight held (embeddings, norms, codes, scales, zero points);
  kv_bytes_per_token, kv_tokens_in_budget: K and V of one token over all layers (scales included),
      and how many tokens fit in --kv-budget-gb;
  decode_tokens_per_s: one batch of --decode-batch requests decoding --decode-tokens tokens in the
      engine (greedy, ignore_eos): batch / decode step time (the fastest of 3 runs' median step).
GPU section (when CUDA is available; --gpu-model, Llama-2-7B shape with random weights by default,
triton backend): per configuration and batch size (--gpu-batch), the engine's median decode step time
(one run: the GPU is not shared) over --gpu-output-len steps of prompts of --gpu-input-len tokens, its
ratio to bf16 at the same batch, and the roofline floor of that weight/KV format
(pipeserve/capacity/roofline.py, lm_head kept in bf16, bandwidth measured in the same run) as a % of the
measured time (100 = at the floor).

Configurations: `none` (the reference), `kv-int8`, `kv-fp8`, `w8a8-int8`, `w8a8-fp8`, `w4a16`, `nf4`,
`w8a8-int8+kv-int8` (PPL.LLM's serving setup), and two trade-off rows that are not engine options:
`w8a8-int8+o_proj` (the O projection quantized too) and `w8a8-int8/per-tensor` (one scale per tensor).
Writes <out>/quant.json and <out>/quant.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeserve.bench.report import machine_info, print_table, write_json
from pipeserve.bench.workload import checkpoint
from pipeserve.config import STEP_EXECUTORS


@dataclass(frozen=True)
class Setup:
    name: str
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    per_tensor: bool = False  # ablation: one scale per weight / activation tensor
    o_proj: bool = False  # trade-off: quantize the O projection as well

    @property
    def engine_options(self) -> dict[str, str]:
        """Engine options; the two trade-off rows quantize after loading (they are not engine options)."""
        ablation = self.per_tensor or self.o_proj
        quantization = "none" if ablation else self.quantization
        return {"quantization": quantization, "kv_cache_dtype": self.kv_cache_dtype}

    @property
    def formats(self) -> tuple[str, str]:
        """(weight, KV) formats as the roofline names them."""
        weight = {"none": "bf16", "w8a8-int8": "int8", "w8a8-fp8": "fp8", "w4a16": "int4", "nf4": "int4"}
        return weight[self.quantization], {"auto": "bf16", "int8": "int8", "fp8": "fp8"}[self.kv_cache_dtype]


SETUPS = {s.name: s for s in (
    Setup("none"),
    Setup("kv-int8", kv_cache_dtype="int8"),
    Setup("kv-fp8", kv_cache_dtype="fp8"),
    Setup("w8a8-int8", "w8a8-int8"),
    Setup("w8a8-fp8", "w8a8-fp8"),
    Setup("w4a16", "w4a16"),
    Setup("nf4", "nf4"),
    Setup("w8a8-int8+kv-int8", "w8a8-int8", "int8"),
    Setup("w8a8-int8+o_proj", "w8a8-int8", o_proj=True),
    Setup("w8a8-int8/per-tensor", "w8a8-int8", per_tensor=True),
)}  # fmt: skip
GPU_SETUPS = ["none", "kv-int8", "w8a8-int8", "w8a8-fp8", "w4a16", "nf4", "w8a8-int8+kv-int8"]
PROMPTS = ["Once upon a time", "Lily and Tom went to the park", "The little dog was sad because",
           "One day, a big bird"]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF checkpoint dir or hub id (default: the shared stories260K)")
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS),
                        help="quantization configurations of the CPU section")
    parser.add_argument("--stories", type=int, default=40, help="stories in the held-out text (~150 tokens)")
    parser.add_argument("--window", type=int, default=256, help="tokens per teacher-forced sequence")
    parser.add_argument("--greedy-tokens", type=int, default=48,
                        help="greedy tokens compared with the unquantized model's")
    parser.add_argument("--kv-budget-gb", type=float, default=1.0, help="KV pool size for the capacity rows")
    parser.add_argument("--decode-batch", type=int, default=16, help="batch of the decode speed rows")
    parser.add_argument("--decode-tokens", type=int, default=64,
                        help="tokens each decode speed row generates")
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads for the CPU section: "
                        "a 260K-parameter model is latency-bound; extra threads on a shared CPU only wait")
    parser.add_argument("--step-executor", choices=STEP_EXECUTORS, default="auto",
                        help="how the engines run their steps (EngineConfig.step_executor)")
    parser.add_argument("--gpu", choices=["auto", "on", "off"], default="auto",
                        help="the GPU section: auto runs it when CUDA is available")
    parser.add_argument("--gpu-model", default="llama-2-7b", help="roofline preset or checkpoint dir")
    parser.add_argument("--gpu-setups", nargs="+", default=GPU_SETUPS, choices=list(SETUPS),
                        help="quantization configurations of the GPU section")
    parser.add_argument("--gpu-batch", nargs="+", type=int, default=[1, 64, 256],
                        help="batch sizes of the GPU section")
    parser.add_argument("--gpu-input-len", type=int, default=512, help="GPU section: prompt tokens")
    parser.add_argument("--gpu-output-len", type=int, default=16, help="GPU section: generated tokens")
    parser.add_argument("--out", default=None, help="directory for quant.json and quant.md "
                        "(default: bench/results/<cpu|gpu name>)")


def open_llm(model: str, setup: Setup, **options: Any):
    """An LLM running `setup` (the trade-off rows are quantized here, after loading)."""
    from pipeserve.engine import LLM
    from pipeserve.engine.quantization.model import quantize_model

    llm = LLM(model, **setup.engine_options, **options)
    if setup.per_tensor or setup.o_proj:
        quantize_model(llm.engine.model, setup.quantization, llm.engine.backend, per_tensor=setup.per_tensor,
                       o_proj=setup.o_proj)
    return llm


def decode_tokens_per_s(llm: Any, batch: int, prompt: list[int], tokens: int,
                        repeats: int = 3) -> tuple[float, float]:  # fmt: skip
    """(decode tokens/s, decode step seconds) of one batch of identical requests, after a warm-up: the
    fastest of `repeats` runs' median steps (other work on a shared machine only ever slows a run)."""
    from pipeserve.bench.harness import run_batch

    run_batch(llm.engine, [prompt] * batch, 2)
    step = min(statistics.median(run_batch(llm.engine, [prompt] * batch, tokens).decode_step_s)
               for _ in range(repeats))
    return batch / step, step


def cpu_section(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pipeserve.engine import SamplingParams
    from pipeserve.engine.kv.pool import kv_bytes_per_token
    from pipeserve.engine.model import accuracy as qeval
    from pipeserve.engine.quantization.model import weight_bytes

    torch.set_num_threads(args.cpu_threads)
    model = checkpoint(args.model, "pipeserve bench quant")
    rows: list[dict[str, Any]] = []
    ref: dict[str, Any] = {}
    greedy = SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True)
    setups = ["none"] + [s for s in args.setups if s != "none"]  # the reference first
    for name in setups:
        setup = SETUPS[name]
        llm = open_llm(model, setup, device="cpu", backend="cpu", max_num_seqs=max(args.decode_batch, 8),
                       step_executor=args.step_executor)
        engine = llm.engine
        if not ref:
            ids = llm.tokenizer(qeval.story_text(args.stories), add_special_tokens=False).input_ids
            ref["seqs"] = qeval.windows(ids, args.window, engine.model_config.bos_token_id)
        logits = qeval.teacher_forced_logits(engine.model, ref["seqs"], setup.kv_cache_dtype)
        ppl = qeval.perplexity(logits, ref["seqs"])
        outputs = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
        if name == "none":
            ref.update(ppl=ppl, logits=logits, outputs=outputs)
        kv_bytes = kv_bytes_per_token(engine.model_config, engine.dtype, setup.kv_cache_dtype)
        prompt = llm.tokenizer(PROMPTS[0]).input_ids
        tps, _ = decode_tokens_per_s(llm, args.decode_batch, prompt, args.decode_tokens)
        rows.append({
            "setup": name, **asdict(setup), "ppl": ppl, "ppl_delta_pct": 100 * (ppl / ref["ppl"] - 1),
            "logits_rel_err": qeval.logits_error(logits, ref["logits"]),
            "greedy_agreement": qeval.token_agreement(outputs, ref["outputs"]),
            "weight_mib": weight_bytes(engine.model) / 2**20, "kv_bytes_per_token": kv_bytes,
            "kv_tokens_in_budget": int(args.kv_budget_gb * 2**30) // kv_bytes, "decode_tokens_per_s": tps,
        })  # fmt: skip
        print(f"{name}: ppl {ppl:.4f} ({rows[-1]['ppl_delta_pct']:+.2f}%), {tps:.0f} tok/s", flush=True)
    return {"model": model, "dtype": str(engine.dtype).removeprefix("torch."),
            "eval_tokens": sum(len(s) for s in ref["seqs"]), "eval_sequences": len(ref["seqs"]),
            "kv_budget_gb": args.kv_budget_gb, "decode_batch": args.decode_batch,
            "decode_tokens": args.decode_tokens, "rows": rows}  # fmt: skip


def gpu_roofline(rates: Any) -> Any:
    """The datasheet entry of this GPU (when known) with the bandwidth measured in this run."""
    from pipeserve.capacity.gpus import GPUS

    key = "".join(c for c in rates.device.lower() if c.isalnum())
    known = [g for n, g in GPUS.items() if "".join(c for c in n.lower() if c.isalnum()) in key]
    if not known:
        return rates.as_gpu()
    return max(known, key=lambda g: len(g.name)).with_overrides(bandwidth=rates.copy_bandwidth)


def gpu_section(args: argparse.Namespace, device: str = "cuda", backend: str = "triton") -> dict[str, Any]:
    """The step-time table (device and backend are parameters so a CPU dry run can check it)."""
    import numpy as np
    import torch

    from pipeserve.bench.harness import resolve_model
    from pipeserve.bench.machine import measure
    from pipeserve.capacity.roofline import ModelShape, cost_model

    rates = measure(device, torch.bfloat16)
    gpu = gpu_roofline(rates)
    model_dir = resolve_model(args.gpu_model)
    shape = ModelShape.from_path(model_dir)
    prompt = np.random.default_rng(0).integers(3, shape.vocab_size, args.gpu_input_len).tolist()
    rows: list[dict[str, Any]] = []
    base: dict[int, float] = {}
    for name in ["none"] + [s for s in args.gpu_setups if s != "none"]:
        setup = SETUPS[name]
        llm = open_llm(model_dir, setup, device=device, backend=backend, max_num_seqs=max(args.gpu_batch),
                       max_num_batched_tokens=max(8192, args.gpu_input_len), step_executor=args.step_executor)
        cost = cost_model(shape, gpu, *setup.formats, quantize_lm_head=False)
        for batch in args.gpu_batch:
            _, step_s = decode_tokens_per_s(llm, batch, prompt, args.gpu_output_len, repeats=1)
            context = args.gpu_input_len + args.gpu_output_len // 2
            floor = cost.decode(batch, context)
            floor_s = floor.t
            base.setdefault(batch, step_s)
            rows.append({"setup": name, "batch": batch, "context": context, "step_ms": step_s * 1e3,
                         "vs_bf16": base[batch] / step_s, "floor_ms": floor_s * 1e3,
                         "floor_mb": floor.bytes / 1e6, "floor_bound": floor.bound,
                         "roofline_pct": 100 * floor_s / step_s})  # fmt: skip
            print(f"{name} batch {batch}: {step_s * 1e3:.3f} ms/step", flush=True)
        del llm
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"model": args.gpu_model, "gpu": gpu.name, "rates": rates.to_json(), "rows": rows}


CPU_COLUMNS = [("setup", "setup"), ("ppl", "ppl"), ("ppl_delta_pct", "Δppl %"),
               ("logits_rel_err", "logits err"), ("greedy_agreement", "greedy agree"),
               ("weight_mib", "weights MiB"),
               ("kv_bytes_per_token", "KV B/token"), ("kv_tokens_in_budget", "KV tokens/budget"),
               ("decode_tokens_per_s", "decode tok/s")]  # fmt: skip
GPU_COLUMNS = [("setup", "setup"), ("batch", "batch"), ("step_ms", "step ms"), ("vs_bf16", "x bf16"),
               ("floor_ms", "floor ms"), ("roofline_pct", "% of floor")]  # fmt: skip


def markdown_table(columns: list[tuple[str, str]], rows: list[dict[str, Any]]) -> str:
    from pipeserve.bench.report import fmt

    lines = ["| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row[key]) for key, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import torch

    load_start = os.getloadavg()
    result: dict[str, Any] = {"machine": machine_info(), "cpu": cpu_section(args)}
    # Other work on the machine slows the speed columns: the 1/5/15-minute load averages tell.
    result["machine"]["load_average"] = {"start": load_start, "end": os.getloadavg()}
    cpu = result["cpu"]
    title = (f"{os.path.basename(cpu['model'])} on the CPU ({cpu['dtype']}, torch backend, "
             f"{args.cpu_threads} thread, load average {load_start[0]:.1f}): {cpu['eval_tokens']} tokens "
             f"teacher-forced, KV budget {cpu['kv_budget_gb']} GiB, decode batch {cpu['decode_batch']}")
    print_table(title, [t for _, t in CPU_COLUMNS], [[r[k] for k, _ in CPU_COLUMNS] for r in cpu["rows"]])
    md = [f"## {title}", "", markdown_table(CPU_COLUMNS, cpu["rows"])]
    if args.gpu == "on" or (args.gpu == "auto" and torch.cuda.is_available()):
        gpu = result["gpu"] = gpu_section(args)
        title = f"{gpu['model']} (random weights) on {gpu['gpu']}: decode step time, triton backend"
        print_table(title, [t for _, t in GPU_COLUMNS], [[r[k] for k, _ in GPU_COLUMNS] for r in gpu["rows"]])
        md += ["", f"## {title}", "", markdown_table(GPU_COLUMNS, gpu["rows"])]
    else:
        print("GPU section skipped: no CUDA device (run with a GPU for the Llama-2-7B step times)")
        md += ["", "GPU section skipped: no CUDA device."]
    device = result["machine"].get("gpu", "cpu").replace(" ", "-")
    out = Path(args.out or Path("bench") / "results" / device)
    write_json(out / "quant.json", result)
    (out / "quant.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / 'quant.json'} and {out / 'quant.md'}")
    return 0
