"""The soak: 10 minutes of steady mixed load with cancels against `pipeserve up` (stories260K by
default), sampling the RSS of every process and the KV pages in use; prints the growth per process
and a verdict (services/bench/soak.py has the details), writes soak.json and soak.png.

    python bench/soak.py                       # 10 minutes, into bench/results/soak/
    python bench/soak.py --seconds 3600 --model /path/to/checkpoint --out /tmp/soak

Not run in CI: tests/reliability/test_soak.py runs 60 seconds of it. Same as `pipeserve bench soak`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services import cli  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(add_help=False)  # --help goes to `pipeserve bench soak`
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "soak"))
    args, rest = parser.parse_known_args()
    return cli.main(["bench", "soak", "--out", args.out, "--json", str(Path(args.out) / "soak.json"), *rest])


if __name__ == "__main__":
    sys.exit(main())
