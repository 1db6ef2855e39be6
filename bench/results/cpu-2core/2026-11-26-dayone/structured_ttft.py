"""Time to first token of the first structured requests through a whole `pipeserve up` (stories260K):
the server is started, and once it says SERVING, REQUESTS requests go one after another, each with a
JSON schema never sent before, then one more with the first schema again. Prints one JSON line.

    PYTHONPATH=<checkout> python structured_ttft.py   # from a checkout whose pipeserve is measured
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from pipeserve.local_cluster import LocalCluster

REQUESTS = 4
STORIES = Path(os.environ.get("PIPESERVE_SHARED", "shared")) / "models" / "stories260K"


def schema(i: int) -> str:
    return json.dumps({"type": "object", "properties": {f"field_{i}": {"type": "integer"},
                                                        "name": {"type": "string", "maxLength": 8}},
                       "required": [f"field_{i}", "name"]})


def ttft(cluster: LocalCluster, text: str) -> float:
    start = time.perf_counter()
    for _ in cluster.client.stream("Once upon a time", max_tokens=4, temperature=0.0, json_schema=text):
        return time.perf_counter() - start
    raise RuntimeError("no token")


def main() -> None:
    log = Path(tempfile.mkdtemp()) / "up.log"
    with LocalCluster(log, str(STORIES), startup=300) as cluster:
        new = [ttft(cluster, schema(i)) for i in range(REQUESTS)]
        again = ttft(cluster, schema(0))
    print(json.dumps({"new_schema_ttft_s": [round(t, 3) for t in new],
                      "same_schema_again_ttft_s": round(again, 3), "load_average": os.getloadavg()}))


if __name__ == "__main__":
    sys.exit(main())
