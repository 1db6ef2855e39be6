"""Where the GPU waits in a synchronous batch-1 decode step: the idle gaps between kernels in the
chrome traces of step_diagnostics.py (20 profiled steps per shape).

    tar xzf step-traces.tgz && python trace_gaps.py > trace-gaps.txt
"""

import collections
import json

STEPS = 20
for shape in ("llama1b", "llama8b"):
    events = json.load(open(f"trace-{shape}.json"))["traceEvents"]
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                "gpu_memset")),
                 key=lambda e: e["ts"])
    pairs = zip(gpu, gpu[1:], strict=False)
    gaps = [(b["ts"] - a["ts"] - a["dur"], a["name"][:40], b["name"][:40]) for a, b in pairs]
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    busy = sum(e["dur"] for e in gpu)
    print(f"== {shape}: per step {span / STEPS:.0f} us, GPU busy {busy / STEPS:.0f} us, "
          f"{len(gpu) / STEPS:.0f} GPU ops")
    by_kind: collections.Counter[tuple[str, str]] = collections.Counter()
    for gap, before, after in gaps:
        if gap > 30:
            by_kind[before, after] += gap
    for (before, after), total in by_kind.most_common(4):
        print(f"  idle {total / STEPS:7.0f} us/step between {before!r} and {after!r}")
    host = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime":
            host[e["name"]] += e["dur"]
    for name, total in host.most_common(3):
        print(f"  host {name}: {total / STEPS:.0f} us/step")
