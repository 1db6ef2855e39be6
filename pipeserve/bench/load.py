"""Peak resident memory while loading a checkpoint: `pipeserve bench load`.

Each measurement runs in a fresh process, which first loads a tiny checkpoint: that pays the
process's one-time costs (the code pages of torch's libraries, its thread pools and allocator), which
are no part of loading a model. Its resident set then is the baseline, its high-water mark (VmHWM)
after loading the measured checkpoint the peak; what loading added is the difference, set against the
bytes of the loaded weights. The resident set right after the imports is reported too.

With `--random-llama N` a random Llama of about N million parameters is first written to --model as
fp32 safetensors (transformers' initialisation), so the figure can be taken on a model large enough
to matter without downloading one."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# Run in the child: a fresh interpreter, so nothing of the parent's heap counts.
CHILD = """
import json, sys, time
import torch
from pipeserve.engine.backend import get_backend
from pipeserve.engine.model.loader import load_model
from pipeserve.engine.quantization.model import weight_bytes

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

model_dir, warm_dir, quantization = sys.argv[1], sys.argv[2], sys.argv[4]
dtype = getattr(torch, sys.argv[3])
torch.set_num_threads(1)
cpu = torch.device("cpu")
imported = status("VmRSS")
load_model(warm_dir, get_backend("cpu"), cpu, dtype, 2048, quantization=quantization)
before = status("VmRSS")
start = time.perf_counter()
model, _ = load_model(model_dir, get_backend("cpu"), cpu, dtype, 2048, quantization=quantization)
seconds = time.perf_counter() - start
print(json.dumps({"imported_rss": imported, "baseline_rss": before, "peak_rss": status("VmHWM"),
                  "weights": weight_bytes(model), "seconds": seconds}))
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (written by --random-llama)")
    parser.add_argument("--random-llama", type=float, default=0.0, metavar="MILLIONS",
                        help="first write a random fp32 Llama of about this many million parameters "
                        "to --model")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"],
                        choices=["float32", "float16", "bfloat16"], help="serving dtypes to load as")
    parser.add_argument("--quantization", nargs="+", default=["none"],
                        help="--quantization methods, applied while loading")
    parser.add_argument("--out", default=None, help="directory for load.json and load.md")


def write_random_llama(model_dir: str, millions: float, hidden: int = 1024, inter: int = 2816,
                       vocab: int = 32000) -> None:
    """A Llama-2-shaped checkpoint (by default hidden 1024, intermediate 2816, 32k vocabulary, untied
    head) with as many layers as make about `millions` million parameters, as fp32 safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((millions * 1e6 - 2 * vocab * hidden) / per_layer))
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, vocab_size=vocab,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # float32: torch's default dtype
    model.save_pretrained(model_dir, safe_serialization=True)


def measure(model_dir: str, warm_dir: str, dtype: str, quantization: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, model_dir, warm_dir, dtype, quantization], check=True,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PIPESERVE_COMPILE": "0"})
    row: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    row["added"] = row["peak_rss"] - row["baseline_rss"]
    row["ratio"] = row["added"] / row["weights"]
    return row


def main(args: argparse.Namespace) -> int:
    if args.random_llama and not os.path.isfile(os.path.join(args.model, "config.json")):
        start = time.perf_counter()
        write_random_llama(args.model, args.random_llama)
        print(f"wrote a random Llama to {args.model} in {time.perf_counter() - start:.0f} s", flush=True)
    files = [n for n in os.listdir(args.model) if n.endswith(".safetensors")]
    checkpoint = sum(os.path.getsize(os.path.join(args.model, n)) for n in files)
    rows = []
    header = ("| serving dtype | quantization | checkpoint MiB | loaded weights MiB | RSS after imports MiB "
              "| baseline RSS MiB | peak RSS MiB | added by loading MiB | added / weights | seconds |")
    lines = [header, "|" + "---|" * 10]
    with tempfile.TemporaryDirectory() as warm_dir:
        write_random_llama(warm_dir, 0.1, hidden=64, inter=128, vocab=256)
        for dtype in args.dtype:
            for method in args.quantization:
                row = measure(args.model, warm_dir, dtype, method)
                rows.append({"dtype": dtype, "quantization": method, "checkpoint": checkpoint, **row})
                keys = ("weights", "imported_rss", "baseline_rss", "peak_rss", "added")
                mib = [f"{row[k] / 2**20:.0f}" for k in keys]
                lines.append(f"| {dtype} | {method} | {checkpoint / 2**20:.0f} | {' | '.join(mib)} "
                             f"| {row['ratio']:.2f}x | {row['seconds']:.1f} |")
                print(lines[-1], flush=True)
    print("\n".join(lines[:2]))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "load.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, "load.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0
