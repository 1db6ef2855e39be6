"""Resident memory added by loading MODEL quantized (W8A8 INT8, bf16) on the CPU after a warm-up load
of WARM: MODEL WARM. Prints added MiB, weight MiB, RSS after MiB."""

import sys

import torch

from pipeserve.engine.backend import get_backend
from pipeserve.engine.model.loader import load_model
from pipeserve.engine.model.quantize import weight_bytes


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


torch.set_num_threads(1)
cpu = torch.device("cpu")
load_model(sys.argv[2], get_backend("cpu"), cpu, torch.bfloat16, 2048, quantization="w8a8-int8")
before = status("VmRSS")
model, _ = load_model(sys.argv[1], get_backend("cpu"), cpu, torch.bfloat16, 2048, quantization="w8a8-int8")
print((status("VmHWM") - before) >> 20, weight_bytes(model) >> 20, status("VmRSS") >> 20)
