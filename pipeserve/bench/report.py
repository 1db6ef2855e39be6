"""Output helpers every bench command shares: JSON files, terminal tables (rich), PNG plots
(matplotlib, Agg backend, imported only when a plot is drawn)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def to_jsonable(obj: Any) -> Any:
    """Plain JSON values: dataclasses become dicts, numpy scalars/arrays become numbers/lists, Paths
    strings, and non-finite floats null (json.dump would write the invalid `Infinity`)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (bool, int, str)) or obj is None:
        return obj
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # numpy scalar or array
        return to_jsonable(obj.tolist())
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")


def write_json(path: str | os.PathLike[str], data: Any) -> Path:
    """Write `data` as indented JSON, creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_jsonable(data), indent=2) + "\n")
    return path


def machine_info() -> dict[str, Any]:
    """Where a result was measured. Reads torch's device only if torch is already imported, so light
    commands stay light."""
    info: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "git_commit": _git_commit(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    return info


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def fmt(value: Any, digits: int = 4) -> str:
    """A table cell: ints with thousands separators, floats to `digits` significant figures."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 10 ** (digits - 1):
            return f"{value:,.0f}"
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}"
    return str(value)


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    console: Console | None = None,
    caption: str | None = None,
) -> Table:
    """Print rows under `columns` (numbers right-aligned, formatted by `fmt`); returns the table."""
    rows = [list(row) for row in rows]
    table = Table(title=title, caption=caption)
    for i, name in enumerate(columns):
        numeric = bool(rows) and all(isinstance(row[i], (int, float)) or row[i] is None for row in rows)
        table.add_column(name, justify="right" if numeric else "left")
    for row in rows:
        table.add_row(*(fmt(v) for v in row))
    # Piped output gets a wide console: rich would otherwise squeeze the table into 80 columns.
    (console or Console(width=None if sys.stdout.isatty() else 200)).print(table)
    return table


@dataclass
class Series:
    """One line of a plot."""

    label: str
    x: Sequence[float]
    y: Sequence[float]
    color: str | None = None
    linestyle: str = "-"
    marker: str | None = "o"


@dataclass
class Panel:
    """One set of axes."""

    ylabel: str
    series: list[Series] = field(default_factory=list)
    xlabel: str = ""
    title: str = ""
    logx: bool = False
    logy: bool = False


PANEL_INCHES = (6.4, 4.8)  # width, height of one panel
DPI = 120


def figure(panels: Sequence[Panel], title: str = "") -> Any:
    """A matplotlib Figure with the panels side by side (close it with matplotlib.pyplot.close)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    width, height = PANEL_INCHES
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), height), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for s in panel.series:
            ax.plot(
                s.x, s.y, label=s.label, color=s.color, linestyle=s.linestyle, marker=s.marker, markersize=3
            )
        if panel.logx:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        if panel.logy:
            ax.set_yscale("log")
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.set_title(panel.title)
        ax.grid(True, which="both", alpha=0.3)
        if panel.series:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_panels(path: str | os.PathLike[str], panels: Sequence[Panel], title: str = "") -> Path:
    """Draw panels side by side into a PNG (PANEL_INCHES x DPI pixels each), creating parent
    directories."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = figure(panels, title)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def cdf_series(label: str, samples: Sequence[float], color: str | None = None) -> Series:
    """The empirical CDF of `samples` as a step-like line (x sorted, y = rank / n)."""
    xs = sorted(samples)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    return Series(label, xs, ys, color=color, marker=None)
