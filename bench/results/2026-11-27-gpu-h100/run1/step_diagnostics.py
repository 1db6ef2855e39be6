"""Run 1's step diagnostics (as run there, reformatted): where a synchronous batch-1 decode step's
time goes on the GPU, for the Llama-3.2-1B and Llama-3-8B shapes (random bf16 weights, CUDA graphs).
Per shape: the engine step against the bucket-1 CUDA graph replayed back to back, cProfile of 100
steps, torch.profiler tables of 20 steps and their chrome trace.

    python3 step_diagnostics.py OUT        # writes OUT/extra.txt (here step-diagnostics.txt), traces
"""

import cProfile
import gc
import io
import pstats
import sys
import tempfile
import time

import torch

from pipeserve.gpu_check.models import write_shape_config
from pipeserve.gpu_check.speed import drain, engine, steady_decode, step_seconds

out = sys.argv[1]
log = open(f"{out}/extra.txt", "w")


def p(*a: object) -> None:
    print(*a, file=log, flush=True)
    print(*a, flush=True)


tmp = tempfile.mkdtemp()
for shape in ("llama1b", "llama8b"):
    eng = engine(write_shape_config(f"{tmp}/{shape}", shape), True, 1, kv_cache_gb=4.0)
    sync = steady_decode(eng, 1, 32, 8, 400)
    wall = step_seconds(eng, 50, sync)
    ex = eng.runner.executor
    g = ex._graphs[1][0]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(100):
        g.replay()
    torch.cuda.synchronize()
    rep = (time.perf_counter() - t) / 100
    p(f"== {shape}: step {wall * 1e3:.3f} ms; graph replay alone {rep * 1e3:.3f} ms; "
      f"rest {1e3 * (wall - rep):.3f} ms")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        eng.step()
    pr.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(45)
        p(s.getvalue())
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(20):
            eng.step()
        torch.cuda.synchronize()
    p(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=110))
    p(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=80))
    prof.export_chrome_trace(f"{out}/trace-{shape}.json")
    drain(eng)
    del eng, ex, g
    gc.collect()
    torch.cuda.empty_cache()
