"""What every step executor offers the runner: the protocol, and the names of the modes."""

from __future__ import annotations

from typing import Protocol

import torch

from .flat import FlatBatch

EAGER, INDUCTOR, CUDA_GRAPH, NATIVE = "eager", "inductor", "cuda-graph", "native"
MODES = (EAGER, INDUCTOR, CUDA_GRAPH, NATIVE)


class StepExecutor(Protocol):
    """Runs a step's rows through the model and returns the logits of the rows it reads out.

    The runner's persistent buffers (buffers.py) are prepared once and refilled by the executor
    itself; a step whose rows an executor does not `cover` runs eager (prefill chunks under Inductor
    or CUDA graphs, batches above the largest bucket, prompt logprobs)."""

    mode: str  # one of MODES
    max_rows: int  # the most rows of one step it runs as one unit (eager: every step's)

    def prepare(self, every_bucket: bool = False) -> None:
        """Compile, capture or build what it needs before the engine serves (every_bucket: every
        compiled unit, also those it would otherwise compile on first use)."""

    def covers(self, flat: FlatBatch) -> bool:
        """Whether it runs this step."""

    def run(self, flat: FlatBatch) -> torch.Tensor | None:
        """Logits [R, V] (float32) of the step's sample_rows, in their order; None when it reads none."""
