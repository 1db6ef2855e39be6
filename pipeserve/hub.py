"""Models as users name them: a local checkpoint directory, or a Hugging Face hub id (`org/name`)
resolved to its snapshot in the standard Hugging Face cache.

A hub id is fetched through huggingface_hub's snapshot_download, which downloads what is missing
when the host has network and otherwise (HF_HUB_OFFLINE=1, or the hub unreachable) returns the
snapshot already in the cache (HF_HOME / HF_HUB_CACHE choose where that is). Only the files a
checkpoint needs are fetched: configs, safetensors weights and the tokenizer. Torch-free.
"""

from __future__ import annotations

import os
import re

# What serving a checkpoint reads: no .bin/.pth/.gguf duplicates of the safetensors weights.
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelNotFound(ValueError):
    """A --model or --tokenizer that names nothing usable; the message says what to do."""


def is_hub_id(name: str) -> bool:
    """`org/name`, and no such path here (a local directory always wins)."""
    return not os.path.exists(name) and _HUB_ID.fullmatch(name) is not None and ".." not in name


def resolve(name: str, revision: str | None = None) -> str:
    """The local directory of a checkpoint named by a path or a hub id (downloaded if needed)."""
    if os.path.isdir(name):
        return name
    if os.path.exists(name):
        raise ModelNotFound(f"{name} is a file: give the checkpoint's directory")
    if not is_hub_id(name):
        raise ModelNotFound(f"{name}: no such directory, and not a Hugging Face hub id (org/name)")
    from huggingface_hub import constants, errors, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{name}" + (f" (revision {revision})" if revision else "")
    try:
        path: str = snapshot_download(name, revision=revision, allow_patterns=CHECKPOINT_PATTERNS)
    except GatedRepoError:
        raise ModelNotFound(f"{where} is gated: accept its licence on the hub, then `hf auth login` "
                            "or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelNotFound(f"{where}: no such directory here, nor model on the Hugging Face hub (a "
                            "private one needs HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelNotFound(f"{where}: the model has no such revision") from None
    except LocalEntryNotFoundError as exc:
        if isinstance(exc, getattr(errors, "IncompleteSnapshotError", ())):  # huggingface_hub >= 2.4
            raise ModelNotFound(f"{where}: the cached snapshot is incomplete and the hub cannot be reached: "
                                "download it again where there is network") from None
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise ModelNotFound(f"{where} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and the "
                            f"hub cannot be reached{offline}: download it where there is network "
                            f"(`hf download '{name}'`) or point HF_HOME at a cache that has it") from None
    except HfHubHTTPError as exc:
        raise ModelNotFound(f"{where}: the Hugging Face hub refused the download: {exc}") from None
    return path


def display_name(name: str) -> str:
    """How a model is shown to clients: a hub id as it is, a directory by its last component."""
    return name if is_hub_id(name) else os.path.basename(os.path.normpath(name))
