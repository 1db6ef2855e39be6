"""Tensor parallelism: the process group of an engine's ranks (`group.py`), the step plan rank 0
sends every step (`step_plan.py`) and the loop ranks 1..T-1 run (`worker.py`). The sharded model
itself is pipeserve/engine/model/tensor_parallel.py."""
