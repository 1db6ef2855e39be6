"""Peak resident memory added by `load_model`, for whichever pipeserve tree is on PYTHONPATH (the
loader's signature is the same before and after the change): MODEL WARM DTYPE."""

import json
import sys

import torch

from pipeserve.engine.backend import get_backend
from pipeserve.engine.model.loader import load_model
from pipeserve.engine.model.quantize import weight_bytes


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


model_dir, warm_dir, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
torch.set_num_threads(1)
cpu = torch.device("cpu")
imported = status("VmRSS")
load_model(warm_dir, get_backend("cpu"), cpu, dtype, 2048)  # torch's one-time costs
before = status("VmRSS")
model, _ = load_model(model_dir, get_backend("cpu"), cpu, dtype, 2048)
added = status("VmHWM") - before
print(json.dumps({"imported_mib": imported >> 20, "baseline_mib": before >> 20,
                  "peak_mib": status("VmHWM") >> 20, "weights_mib": weight_bytes(model) >> 20,
                  "added_mib": added >> 20,
                  "ratio": round(added / weight_bytes(model), 2)}))
