"""How a step runs: one executor per mode, chosen once at engine start (select.py).

| mode       | chosen by `auto` when                                  | runs                              |
|------------|--------------------------------------------------------|-----------------------------------|
| native     | CPU, cpu backend, dense fp32 model (model/llama.py's   | any step of up to max(max rows,   |
|            | NATIVE_STEP), native kernels built                     | 64) rows, prefill rows included   |
| inductor   | CPU, cpu backend, any other model, a C++ compiler      | decode/verification steps up to   |
|            |                                                        | 64 rows, one compile per bucket   |
| cuda-graph | CUDA, triton backend                                   | decode/verification steps up to   |
|            |                                                        | --max-cuda-graph-batch rows       |
| eager      | everything else (reference backend, Triton under its   | every step                        |
|            | CPU interpreter, tensor parallelism, --no-compile)     |                                   |

A step the chosen executor does not cover runs eager, so a decode step takes one of two paths:
the chosen executor or the eager one.
"""

from .base import MODES, StepExecutor
from .buffers import StepBuffers
from .eager import EagerStep
from .flat import DeviceIds, FlatBatch
from .select import StepPlan, select_executor

__all__ = ["MODES", "DeviceIds", "EagerStep", "FlatBatch", "StepBuffers", "StepExecutor", "StepPlan",
           "select_executor"]
