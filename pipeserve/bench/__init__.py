"""Measurements: `pipeserve bench ...` (pipeserve/cli.py lists them), each in its own module, on the
shared model shapes of `shapes.py`, reporting through `report.py` with the serving metrics of
`metrics.py` on the workloads of `workload.py`. Modelled figures (roofline, simulator) are
pipeserve.capacity."""
