"""`pipeserve gpu-check`: one command that checks a CUDA host for serving: its environment and measured
ceilings, every Triton kernel against its torch reference, engine parity across backends, CUDA graphs
and transformers, one sync per decode step, and the speed rows later tuning is measured by.

- cli.py: the command (flags, the no-CUDA exit, output files)
- runner.py: sections, each in its own process under its own time limit
- report.py: rows, thresholds, gpu-check.json and the markdown table
- environment.py, kernels.py, parity.py, sync.py, speed.py: the sections
- models.py: tiny random checkpoints and full-size shapes with random weights (shared with the tests)
Needs only the runtime dependencies (torch, triton, transformers), not the bench extra.
"""
