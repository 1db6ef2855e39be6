"""Container healthcheck probe: `python -m pipeserve.gateway.healthcheck grpc HOST:PORT` exits 0 when the
gateway's health service says SERVING; `... tcp HOST:PORT` exits 0 when something accepts TCP there
(the engine binds its ports only once the model is loaded; the detokenizer binds `steps`)."""

from __future__ import annotations

import socket
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("grpc", "tcp"):
        print(__doc__, file=sys.stderr)
        return 2
    kind, target = argv
    if kind == "tcp":
        host, _, port = target.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
            return 0
        except OSError as exc:
            print(f"{target}: {exc}", file=sys.stderr)
            return 1
    from pipeserve.gateway.client import Client

    with Client(target) as client:
        status = client.health(timeout=3)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
