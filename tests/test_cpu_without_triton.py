"""tools/install.py leaves Triton out on a host whose torch has no CUDA: the CPU serving path must
then never import it. A fresh interpreter in which `import triton` fails builds the engine as
`pipeserve serve` does (device and backend "auto" on a CPU host) and serves structured outputs
(xgrammar masks CPU logits with its own C++ kernel) on stories260K."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

# A fresh interpreter that imports torch and xgrammar and builds an engine: ~9 CPU-seconds.
pytestmark = pytest.mark.slow

SCRIPT = r"""
import importlib.abc, json, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, NoTriton())

from pipeserve.engine.llm import LLM
from pipeserve.sampling_params import SamplingParams

llm = LLM(model=sys.argv[1], device="auto", num_pages=64)
schema = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"],
          "additionalProperties": False}
outs = llm.generate(["Once upon a time", "The cat"], [
    SamplingParams(max_tokens=24, temperature=0.0, json_schema=schema),
    SamplingParams(max_tokens=8, temperature=1.0, seed=1, choice=["yes", "no"]),
])
print(json.dumps({"texts": [o.text for o in outs],
                  "finish": [o.finish_reason for o in outs],
                  "triton": sorted(m for m in sys.modules if m.split(".")[0] == "triton")}))
llm.engine.close()
"""


def test_cpu_serving_and_structured_outputs_never_import_triton(stories_dir: str) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, stories_dir], capture_output=True, text=True,
                         timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["triton"] == []
    assert json.loads(result["texts"][0]) in ({"mood": "happy"}, {"mood": "sad"})
    assert result["texts"][1] in ("yes", "no") and result["finish"] == ["stop", "stop"]
