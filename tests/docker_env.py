"""Docker for the compose test, on a host where Docker Hub is out of reach: start dockerd if it is not
running (root only), build the base image from Debian's own repositories (debootstrap minbase of this
host's release, `docker import`), and give `docker build` the host's pip sources: the local wheel
folders and file:// indexes of `pip config list` are served over HTTP on 127.0.0.1 (the build runs
with --network host), so the image takes the CPU torch wheel the host has instead of CUDA wheels, and
the CA certificates the host added to Debian's are trusted in the image too (EXTRA_CA_CERTS).

Cached between runs under ~/.cache/pipeserve/docker (or $PIPESERVE_DOCKER_CACHE): the base image's
tarball; Docker's own layer cache keeps the installed wheels while pyproject.toml is unchanged."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

CACHE = Path(os.environ.get("PIPESERVE_DOCKER_CACHE", Path.home() / ".cache" / "pipeserve" / "docker"))
STABLE_PORTS = range(38400, 38420)
EXTRA_CA_DIR = Path("/usr/local/share/ca-certificates")  # where Debian keeps locally added CAs


def run(*cmd: str, timeout: float = 600, check: bool = True, **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check, **kwargs)


def docker_problem() -> str | None:
    """None when the Docker daemon answers (started here if need be), else why not."""
    for tool in ("docker", "docker-compose"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (`make test` installs Debian's docker.io and docker-compose)"
    if run("docker", "info", timeout=60, check=False).returncode == 0:
        return None
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        return "the Docker daemon is not running and cannot be started here (needs dockerd and root)"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "dockerd.log", "ab") as log:
        subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if run("docker", "info", timeout=60, check=False).returncode == 0:
            return None
        time.sleep(1)
    return f"dockerd did not start within 60 s (see {CACHE / 'dockerd.log'})"


def debian_release() -> str:
    fields = dict(
        line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line
    )
    return fields["VERSION_CODENAME"].strip('"')


def base_image() -> str:
    """pipeserve-base:<release>: a minbase Debian of this host's release, imported from the cached
    tarball (debootstrapped once)."""
    release = debian_release()
    tag = f"pipeserve-base:{release}"
    if run("docker", "image", "inspect", tag, check=False).returncode == 0:
        return tag
    tarball = CACHE / f"debian-{release}-minbase.tar"
    if not tarball.is_file():
        if shutil.which("debootstrap") is None:
            raise RuntimeError("debootstrap is not installed (`apt-get install debootstrap`)")
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as root:
            mirror = "http://deb.debian.org/debian"
            run("debootstrap", "--variant=minbase", release, root, mirror, timeout=900)
            partial = tarball.with_suffix(".partial")
            run("tar", "-C", root, "-cf", str(partial), ".", timeout=300)
            partial.rename(tarball)
    run("docker", "import", str(tarball), tag, timeout=300)
    return tag


def pip_sources() -> tuple[dict[str, Path], list[str], list[str]]:
    """The host's local pip sources: name -> folder to serve, and the find-links and extra index
    names (relative URLs under the served root), from `pip config list`."""
    out = run(sys.executable, "-m", "pip", "config", "list", check=False).stdout
    served: dict[str, Path] = {}
    find_links: list[str] = []
    indexes: list[str] = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        for item in value.strip().strip("'\"").split():
            path = Path(item.removeprefix("file://"))
            if path in served.values() or path.parent in served.values():
                continue
            if option == "find-links" and path.is_dir():
                name = f"links{len(served)}"
                served[name] = path
                find_links.append(f"{name}/")
            elif option == "extra-index-url" and item.startswith("file://") and path.is_dir():
                # An index's pages link to ../../files/...: serve the index's parent folder.
                name = f"index{len(served)}"
                served[name] = path.parent
                indexes.append(f"{name}/{path.name}/")
    return served, find_links, indexes


@contextlib.contextmanager
def pip_args() -> Iterator[str]:
    """PIP_ARGS for `docker build --network host`: the host's local pip sources over HTTP."""
    served, find_links, indexes = pip_sources()
    with tempfile.TemporaryDirectory() as root:
        for name, path in served.items():
            os.symlink(path, os.path.join(root, name))
        server = serve_folder(root)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        base = f"http://127.0.0.1:{server.server_address[1]}"
        args = [f"--find-links {base}/{link}" for link in find_links]
        args += [f"--extra-index-url {base}/{index}" for index in indexes]
        try:
            yield " ".join([*args, "--trusted-host 127.0.0.1"])
        finally:
            server.shutdown()
            server.server_close()


def serve_folder(root: str) -> http.server.ThreadingHTTPServer:
    """An HTTP server for root on the first free port of STABLE_PORTS: PIP_ARGS names the port, and a
    build argument that changes from run to run would void Docker's layer cache (the wheels)."""
    handler = functools.partial(_QuietHandler, directory=root)
    for port in STABLE_PORTS:
        try:
            return http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        except OSError:
            continue
    return http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


def extra_ca_certs() -> str:
    """The CA certificates this host trusts besides Debian's (e.g. a TLS-intercepting proxy's), PEM."""
    return "\n".join(path.read_text().strip() for path in sorted(EXTRA_CA_DIR.glob("*.crt")))


def build_image(repo: Path, tag: str) -> None:
    """The repository's Dockerfile on the debootstrapped base, with the host's CPU torch wheel and CA
    certificates."""
    base = base_image()
    with pip_args() as extra:
        out = run("docker", "build", "--force-rm", "--network", "host", "-t", tag,
                  "--build-arg", f"BASE={base}", "--build-arg", f"PIP_ARGS={extra}",
                  "--build-arg", f"EXTRA_CA_CERTS={extra_ca_certs()}", str(repo), timeout=900, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"docker build failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
