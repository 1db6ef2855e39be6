"""One child process of `pipeserve up`, local or on a Ray node: how it is started (`CHILD`, a fresh
interpreter that sets its parent-death signal, names itself and runs the ordinary CLI), and the
supervisor's view of it (`Child`, `Proc`). pipeserve/launcher.py starts children on this host,
pipeserve/ray_launcher.py on a Ray cluster's nodes; both import this module, neither the other.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

# Runs a child: parent-death signal first (a fresh interpreter has no threads yet, unlike this
# process, whose ZeroMQ context makes preexec_fn unsafe), then the ordinary CLI.
CHILD = "import sys; from pipeserve.child import child_main; sys.exit(child_main(sys.argv[1:]))"
PR_SET_PDEATHSIG = 1

TITLE = "pipeserve: "  # what `ps` shows before a child's name


def set_title(name: str) -> None:
    """What `ps`/`top` show for this process: "pipeserve: NAME" rather than the interpreter's argv.
    Written over argv only (SPT_NOENV), so /proc/PID/environ still shows the process's environment."""
    os.environ["SPT_NOENV"] = "1"
    import setproctitle

    setproctitle.setproctitle(TITLE + name)


def child_main(argv: list[str]) -> int:
    parent = int(os.environ["PIPESERVE_PARENT_PID"])
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            return 1
    set_title(os.environ.get("PIPESERVE_PROCESS_NAME", argv[0]))
    from pipeserve.cpus import apply_from_env

    apply_from_env()
    from pipeserve.cli import main

    return main(argv)


class Proc(Protocol):
    """A started child: a local subprocess.Popen, or one on a Ray node (pipeserve/ray_launcher.py)."""

    pid: int
    returncode: int | Any

    def poll(self) -> int | None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


# Starts a child's process with this environment (the supervisor's, the child's, its name on top).
Starter = Callable[["Child", dict[str, str]], Proc]


def start_local(child: Child, env: dict[str, str]) -> Proc:
    return subprocess.Popen([sys.executable, "-c", CHILD, *child.argv], env=env, start_new_session=True)


@dataclass
class Child:
    name: str  # "engine-0", "detokenizer", "tokenizer-0", ..., "gateway"
    argv: list[str]  # pipeserve subcommand and flags
    proc: Proc | None = None
    restarts: list[float] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of the supervisor's (e.g. PIPESERVE_CPUS)
