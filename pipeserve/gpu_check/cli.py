"""The `pipeserve gpu-check` command."""

from __future__ import annotations

import argparse
import sys

from .runner import SECTIONS, Section, run_sections, stop_on_sigterm


def select_sections(names: str | None) -> tuple[Section, ...]:
    """The sections named (comma-separated), in their fixed order; every one when names is None."""
    if names is None:
        return SECTIONS
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = wanted - {s.name for s in SECTIONS}
    if unknown:
        raise SystemExit(f"pipeserve gpu-check: no section {', '.join(sorted(unknown))}; the sections are "
                         f"{', '.join(s.name for s in SECTIONS)}")
    return tuple(s for s in SECTIONS if s.name in wanted)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sections = ", ".join(f"{s.name} ({s.limit_s:.0f} s)" for s in SECTIONS)
    parser.description = (
        "Check this CUDA host: environment, measured ceilings (copy GB/s, bf16 TFLOP/s), every Triton "
        "kernel against its torch reference, engine parity (reference / Triton eager / CUDA graphs / "
        "transformers, quantized top-1 agreement), one sync per decode step, and speed rows. Each section "
        f"runs in its own process under its own time limit: {sections}. Exit status 1 when a "
        "correctness row fails, 2 on a host without CUDA.")
    parser.add_argument("--out", default="gpu-check",
                        help="directory for gpu-check.json and gpu-check.md (the table as markdown)")
    parser.add_argument("--quick", action="store_true",
                        help="only the environment, kernel, parity and serving sections (about 2 minutes on "
                             "an H100)")
    parser.add_argument("--sections", default=None, metavar="NAME[,NAME...]",
                        help="only these sections, in the order above (the speed rows' floors need "
                             "ceilings: name it too); overrides --quick")


def main(args: argparse.Namespace) -> int:
    import torch

    sections = select_sections(args.sections)
    if not torch.cuda.is_available():
        print(f"pipeserve gpu-check: no CUDA device on this host (torch {torch.__version__}, "
              f"CUDA {torch.version.cuda or 'none'}); run it on a GPU host", file=sys.stderr)
        return 2
    stop_on_sigterm()  # a run cut short by `timeout` still writes the report of what ran
    report = run_sections(sections, "cuda", args.quick and args.sections is None,
                          echo=lambda line: print(line, flush=True))
    json_path, md_path = report.write(args.out)
    print(report.markdown())
    failed = report.failed
    print(f"gpu-check: {len(report.correctness) - len(failed)}/{len(report.correctness)} correctness rows "
          f"passed; wrote {json_path} and {md_path}")
    for row in failed:
        print(f"FAILED {row.name}: {row.detail or f'error {row.error} > {row.threshold}'}")
    return report.exit_status()
