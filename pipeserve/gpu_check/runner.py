"""Runs gpu-check's sections, each in its own child process under its own time limit.

A child process per section isolates them: a kernel that faults (an illegal address poisons the whole
CUDA context), hangs or runs out of memory ends only its section, whose rows so far are kept (a
section emits each row as soon as it is measured, one JSON line to a file) and whose failure is
reported with its reason while the next section runs. The parent never touches CUDA."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .report import CorrectnessRow, Report, SectionResult


@dataclass(frozen=True)
class Section:
    name: str
    target: str  # "module:function", called with a Context in the child
    limit_s: float
    quick: bool  # part of --quick
    correctness: bool  # a failure of the section itself fails the check


SECTIONS = (
    Section("environment", "pipeserve.gpu_check.environment:environment", 30, True, False),
    Section("ceilings", "pipeserve.gpu_check.environment:ceilings", 60, False, False),
    Section("kernels", "pipeserve.gpu_check.kernels:run", 240, True, True),
    Section("parity", "pipeserve.gpu_check.parity:run", 240, True, True),
    Section("serving", "pipeserve.gpu_check.serving:run", 90, True, True),
    Section("sync", "pipeserve.gpu_check.sync:run", 120, False, True),
    Section("speed", "pipeserve.gpu_check.speed:run", 300, False, False),
    Section("quant", "pipeserve.gpu_check.quant:run", 240, False, False),
    Section("profile", "pipeserve.gpu_check.profile:run", 150, False, False),
)


STOPPED = "stopped: the whole run was told to stop (SIGTERM)"


@dataclass
class Context:
    """What a section function gets: where it runs, and `emit` for its results."""

    device: str
    quick: bool
    ceilings: dict[str, float | None] = field(default_factory=dict)
    records: str | None = None  # the JSON-lines file the parent reads; None: kept in `emitted`
    emitted: list[dict[str, Any]] = field(default_factory=list)

    def emit(self, kind: str, data: Any) -> None:
        record = {"kind": kind, "data": data}
        self.emitted.append(record)
        if self.records is not None:
            with open(self.records, "a") as f:
                f.write(json.dumps(record, default=_jsonable) + "\n")

    def row(self, row: Any) -> None:
        """Emit a CorrectnessRow or SpeedRow."""
        from dataclasses import asdict

        self.emit("correctness" if isinstance(row, CorrectnessRow) else "speed", asdict(row))


class Stopped(Exception):
    """The whole run was told to stop (SIGTERM): the section in flight ends as a timeout, the rest
    are not run, and the report of what ran is still written."""


def stop_on_sigterm() -> None:
    """Turn SIGTERM (`timeout`, a scheduler's limit) into Stopped in the parent."""

    def handler(signum: int, frame: object) -> None:
        raise Stopped()

    signal.signal(signal.SIGTERM, handler)


def run_parts(parts: dict[str, Callable[[], None]],
              between: Callable[[], object] = lambda: None) -> list[str]:
    """Run a section's parts in turn, `between` after each; a failing part does not hide the others'
    rows: the one-line reasons of those that failed."""
    failed = []
    for name, part in parts.items():
        try:
            part()
        except Exception as exc:
            failed.append(f"{name}: {type(exc).__name__}: {exc}".splitlines()[0][:200])
        between()
    return failed


def _jsonable(value: Any) -> Any:
    return float(value) if hasattr(value, "__float__") else str(value)


def run_sections(sections: Iterable[Section], device: str, quick: bool,
                 echo: Callable[[str], None] = print) -> Report:
    """Every section in order, each in a child process; one Report of them all."""
    report = Report()
    for section in sections:
        if quick and not section.quick:
            continue
        result, records = run_section(section, device, quick, report.ceilings)
        stopped = result.reason == STOPPED
        for record in records:
            if record["kind"] != "error":
                report.add(record)
        report.sections.append(result)
        if result.status != "ok" and section.correctness:
            report.correctness.append(CorrectnessRow.check(f"{section.name} section", False, result.reason))
        tail = f": {result.reason}" if result.reason else ""
        echo(f"gpu-check: {section.name} {result.status} in {result.seconds:.1f} s{tail}")
        if stopped:
            break
    return report


def run_section(section: Section, device: str, quick: bool,
                ceilings: dict[str, float | None]) -> tuple[SectionResult, list[dict[str, Any]]]:
    """Run one section in a child process, killed (with its process group) at its time limit."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        records = Path(tmp) / "records.jsonl"
        spec = {"target": section.target, "device": device, "quick": quick, "ceilings": ceilings,
                "records": str(records)}
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "pipeserve.gpu_check.runner", json.dumps(spec)],
                                start_new_session=True)
        reason = f"over its {section.limit_s:.0f} s limit"
        try:
            rc = proc.wait(timeout=section.limit_s)
        except (subprocess.TimeoutExpired, Stopped) as exc:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
            if isinstance(exc, Stopped):
                reason = STOPPED
        seconds = time.perf_counter() - start
        emitted = [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []
    errors = [r["data"] for r in emitted if r["kind"] == "error"]
    if rc is None:
        result = SectionResult(section.name, seconds, "timeout", reason)
    elif rc == 0:
        result = SectionResult(section.name, seconds, "ok")
    else:
        reason = errors[-1] if errors else f"the section's process exited with status {rc}"
        result = SectionResult(section.name, seconds, "failed", reason)
    return result, emitted


def child_main(spec_json: str) -> int:
    """The child: call the section function; an exception becomes an `error` record and status 1."""
    spec = json.loads(spec_json)
    ctx = Context(spec["device"], spec["quick"], spec["ceilings"], spec["records"])
    try:
        module, name = spec["target"].split(":")
        getattr(importlib.import_module(module), name)(ctx)
    except Exception as exc:  # reported to the parent, whatever it is
        traceback.print_exc()
        ctx.emit("error", f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))
