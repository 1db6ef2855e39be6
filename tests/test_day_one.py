"""`pipeserve up` on a model named as users name it: a hub id served from a pre-filled Hugging Face
cache (HF_HUB_OFFLINE=1: nothing is downloaded) whose snapshot ships only the slow tokenizer, with its
generation_config.json sampling defaults, a served model name and a chat template from a file."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeserve.local_cluster import LocalCluster
from pipeserve.sampling_params import SamplingParams
from pipeserve.tokenizer.load import load_tokenizer
from tests.conftest import STORIES
from tests.hf_cache import add_snapshot

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not (STORIES / "config.json").is_file(), reason=f"stories260K not found at {STORIES}"),
]
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
DEFAULTS = {"temperature": 0.0, "top_k": 7}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Path]]:
    root = tmp_path_factory.mktemp("day-one")
    checkpoint = root / "checkpoint"
    shutil.copytree(STORIES, checkpoint)
    (checkpoint / "tokenizer.json").unlink()  # slow tokenizer only: converted at start-up
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **DEFAULTS}))
    snapshot = add_snapshot(root / "hub", "tiny/stories", checkpoint, "c" * 40)
    (root / "chat.jinja").write_text(TEMPLATE)
    env = {"HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1", "PIPESERVE_CACHE": str(root / "cache")}
    flags = ("--revision", "main", "--served-model-name", "stories-chat",
             "--chat-template", str(root / "chat.jinja"))
    with LocalCluster(root / "up.log", "tiny/stories", *flags, env=env, startup=120) as cluster:
        yield cluster, snapshot


@pytest.fixture(scope="module")
def llm():
    from pipeserve.engine import LLM

    return LLM(str(STORIES), device="cpu")


def test_model_info_names_the_model_and_its_sampling_defaults(served) -> None:
    cluster, _ = served
    info = cluster.client.model_info()
    assert info.name == "stories-chat" and info.context_length == 512
    assert dict(info.sampling_defaults) == DEFAULTS


def test_unset_sampling_fields_take_the_generation_config_defaults(served, llm) -> None:
    cluster, _ = served
    greedy = llm.generate(["Once upon a time"], SamplingParams(max_tokens=24, temperature=0.0))[0].text
    # temperature left unset: the checkpoint's 0.0 applies, so the text is the greedy one every time.
    assert [cluster.client.generate("Once upon a time", max_tokens=24).text for _ in range(3)] == [greedy] * 3
    sampled = {cluster.client.generate("Once upon a time", max_tokens=24, temperature=1.0, seed=s).text
               for s in range(4)}
    assert sampled != {greedy}  # an explicit value wins over the default


def test_chat_requests_use_the_given_template(served, llm) -> None:
    cluster, snapshot = served
    chat = [{"role": "user", "content": "Tell me a story"}]
    tokenizer = load_tokenizer(str(snapshot), TEMPLATE)
    ids = tokenizer.encode(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    assert ids[0] == tokenizer.bos_token_id and len(ids) > 5
    expected = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0].text
    assert cluster.client.generate(chat, max_tokens=16).text == expected
