"""What `pipeserve gpu-check` reports: rows, sections, the gpu-check.json document, the printed and
markdown tables, and the exit status. Plain data, no torch: the runner's parent process and the tests
use it without a GPU."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Bound on the relative error max|out - ref| / max|ref| of a kernel against its torch reference, by
# the precision its output is computed in. The quantizing kernels (their own int8 / fp8 codes) may
# land one rounding step of a code away from the reference's: their bounds are the errors measured
# on the CPU (tests/test_gpu_check.py, docs/gpu.md) with a margin.
THRESHOLDS: dict[str, float] = {
    "fp32": 1e-4,
    "tf32": 1e-3,
    "fp16": 1e-3,
    "bf16": 1e-2,
    "int8": 1e-2,
    # A W8A8 MoE quantizes twice (its input, then the intermediate activation after SiLU-and-mul), and
    # the second quantization sees bf16 values that two implementations may round differently: a code
    # can land a step apart in each. Measured on an H100: 1.1e-2 to 1.4e-2.
    "int8 twice": 2e-2,
    "fp8": 7e-2,
}
# Teacher-forced top-1 agreement of a quantized tiny random model with its unquantized run (a fraction):
# the agreement measured on the CPU (cpu backend, fp32; llama / mixtral: int8 0.96 / 0.97, fp8 0.87 /
# 0.86, w4a16 0.65 / 0.67, nf4 0.59 / 0.53) less a margin. Random weights give flat logits, hence the
# low 4-bit figures; a real checkpoint agrees far more.
AGREEMENT: dict[str, float] = {"w8a8-int8": 0.9, "w8a8-fp8": 0.8, "w4a16": 0.55, "nf4": 0.45}

STATUSES = ("ok", "failed", "timeout", "skipped")


@dataclass
class CorrectnessRow:
    name: str
    passed: bool
    error: float | None  # the measured error (relative error, or 1 - agreement); None: not measured
    threshold: float | None
    detail: str = ""

    @classmethod
    def measured(cls, name: str, error: float, threshold: float, detail: str = "") -> CorrectnessRow:
        """Passes when the error is finite and within the threshold (NaN from poison never passes)."""
        return cls(name, math.isfinite(error) and error <= threshold, error, threshold, detail)

    @classmethod
    def check(cls, name: str, passed: bool, detail: str = "") -> CorrectnessRow:
        """A yes/no check (identical tokens, one sync per step): error 0 or 1, threshold 0."""
        return cls(name, passed, 0.0 if passed else 1.0, 0.0, detail)


@dataclass
class SpeedRow:
    name: str
    value: float | None
    unit: str
    pct_of_floor: float | None = None  # a percentage (82.5, not 0.825) where a floor applies
    detail: str = ""


@dataclass
class SectionResult:
    name: str
    seconds: float
    status: str  # one of STATUSES
    reason: str = ""  # why it failed, timed out or was skipped


@dataclass
class Report:
    environment: dict[str, Any] = field(default_factory=dict)
    ceilings: dict[str, float | None] = field(
        default_factory=lambda: {"copy_gbps": None, "bf16_tflops": None})
    correctness: list[CorrectnessRow] = field(default_factory=list)
    speed: list[SpeedRow] = field(default_factory=list)
    sections: list[SectionResult] = field(default_factory=list)

    def add(self, record: dict[str, Any]) -> None:
        """One record a section emitted (runner.Context.emit)."""
        kind, data = record["kind"], record["data"]
        if kind == "environment":
            self.environment.update(data)
        elif kind == "ceilings":
            self.ceilings.update(data)
        elif kind == "correctness":
            self.correctness.append(CorrectnessRow(**data))
        elif kind == "speed":
            self.speed.append(SpeedRow(**data))
        else:
            raise ValueError(f"unknown record kind {kind!r}")

    @property
    def failed(self) -> list[CorrectnessRow]:
        return [row for row in self.correctness if not row.passed]

    def exit_status(self) -> int:
        """0 when every correctness row passed, else 1."""
        return 1 if self.failed else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "environment": self.environment,
            "ceilings": self.ceilings,
            "correctness": [asdict(r) for r in self.correctness],
            "speed": [asdict(r) for r in self.speed],
            "sections": [asdict(s) for s in self.sections],
        }

    def markdown(self) -> str:
        """The whole report as markdown tables."""
        env = [[k, str(v)] for k, v in self.environment.items()]
        ceil = [[k, fmt(v)] for k, v in self.ceilings.items()]
        corr = [[r.name, "pass" if r.passed else "FAIL", fmt(r.error), fmt(r.threshold), r.detail]
                for r in self.correctness]
        speed = [[r.name, fmt(r.value), r.unit, fmt(r.pct_of_floor), r.detail] for r in self.speed]
        secs = [[s.name, s.status, f"{s.seconds:.1f}", s.reason] for s in self.sections]
        parts = [
            "## Environment", table(["key", "value"], env),
            "## Ceilings", table(["ceiling", "value"], ceil),
            "## Correctness", table(["check", "result", "error", "threshold", "detail"], corr),
            "## Speed", table(["row", "value", "unit", "% of floor", "detail"], speed),
            "## Sections", table(["section", "status", "seconds", "reason"], secs),
        ]
        return "\n\n".join(parts) + "\n"

    def write(self, out_dir: str | Path) -> tuple[Path, Path]:
        """gpu-check.json and gpu-check.md under out_dir (created)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        json_path, md_path = out / "gpu-check.json", out / "gpu-check.md"
        json_path.write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")
        md_path.write_text("# pipeserve gpu-check\n\n" + self.markdown())
        return json_path, md_path


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.2e}"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table (pipes in cells escaped); a placeholder row when empty."""
    rows = rows or [["(none)", *[""] * (len(header) - 1)]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) + " |" for row in rows]
    return "\n".join(lines)
