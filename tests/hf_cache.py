"""A pre-filled Hugging Face hub cache, laid out as huggingface_hub writes it, so hub ids resolve
offline (HF_HUB_OFFLINE=1): nothing is ever downloaded in the tests."""

from __future__ import annotations

import shutil
from pathlib import Path


def add_snapshot(cache: Path, repo_id: str, files: Path, commit: str, branch: str = "main",
                 skip: tuple[str, ...] = ()) -> Path:
    """Put the files of a checkpoint dir into `cache` as `repo_id` at `commit`, which `branch` points
    to; files named in skip are left out. Returns the snapshot dir."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for path in files.iterdir():
        if path.name not in skip and path.is_file():
            shutil.copyfile(path, snapshot / path.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot
