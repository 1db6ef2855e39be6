"""Models as users name them: hub ids through a pre-filled Hugging Face cache (offline, never the
network), revisions, and checkpoints that ship only a slow tokenizer (converted to a fast one)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pipeserve import hub
from pipeserve.tokenizer.load import fast_tokenizer_dir, load_tokenizer, read_chat_template
from tests.hf_cache import add_snapshot

MAIN, V1 = "a" * 40, "b" * 40


@pytest.fixture
def hf_cache(tmp_path: Path, stories_dir: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    add_snapshot(cache, "tiny/stories", Path(stories_dir), MAIN)
    add_snapshot(cache, "tiny/stories", Path(stories_dir), V1, branch="v1", skip=("generation_config.json",))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_ids_resolve_from_the_cache_offline(hf_cache: Path) -> None:
    main = hub.resolve("tiny/stories")
    assert Path(main) == hf_cache / "models--tiny--stories" / "snapshots" / MAIN
    assert os.path.isfile(os.path.join(main, "model.safetensors"))
    assert Path(hub.resolve("tiny/stories", revision="v1")).name == V1
    assert Path(hub.resolve("tiny/stories", revision=V1)).name == V1
    assert hub.display_name("tiny/stories") == "tiny/stories"


def test_missing_models_say_what_to_do(hf_cache: Path, tmp_path: Path) -> None:
    offline = r"not in the Hugging Face cache .* \(HF_HUB_OFFLINE is set\)"
    with pytest.raises(hub.ModelNotFound, match=offline) as missing:
        hub.resolve("tiny/missing")
    assert "`hf download 'tiny/missing'`" in str(missing.value) and "{name}" not in str(missing.value)
    with pytest.raises(hub.ModelNotFound, match="revision v9"):
        hub.resolve("tiny/stories", revision="v9")
    with pytest.raises(hub.ModelNotFound, match="no such directory, and not a Hugging Face hub id"):
        hub.resolve(str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(hub.ModelNotFound, match="is a file"):
        hub.resolve(str(tmp_path / "file"))


def test_a_local_directory_wins_over_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not hub.is_hub_id("org/name") and hub.resolve("org/name") == "org/name"
    assert hub.is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert not hub.is_hub_id("/abs/path") and not hub.is_hub_id("a/b/c") and not hub.is_hub_id("../x")


def test_a_slow_only_tokenizer_is_converted_once_and_matches_the_fast_one(
    stories_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPESERVE_CACHE", str(tmp_path / "cache"))
    slow = tmp_path / "slow"
    shutil.copytree(stories_dir, slow)
    (slow / "tokenizer.json").unlink()
    fast, converted = load_tokenizer(stories_dir), load_tokenizer(str(slow))
    text = "Once upon a time, Lily saw a big dog. She said: \"Hi!\"\n  The end 123."
    import sentencepiece

    reference = sentencepiece.SentencePieceProcessor(model_file=str(slow / "tokenizer.model"))
    assert converted.encode(text) == fast.encode(text) == [fast.bos_token_id, *reference.encode(text)]
    ids = fast.encode(text)
    assert converted.decode(ids) == fast.decode(ids)
    assert (converted.bos_token, converted.eos_token) == (fast.bos_token, fast.eos_token)
    first = fast_tokenizer_dir(str(slow))
    assert first.startswith(str(tmp_path / "cache")) and os.path.isfile(os.path.join(first, "tokenizer.json"))
    stamp = os.stat(os.path.join(first, "tokenizer.json")).st_mtime_ns
    assert fast_tokenizer_dir(str(slow)) == first  # cached: not converted again
    assert os.stat(os.path.join(first, "tokenizer.json")).st_mtime_ns == stamp
    (slow / "tokenizer.model").unlink()
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor tokenizer.model"):
        fast_tokenizer_dir(str(slow))


def test_chat_template_from_a_file_or_inline(stories_dir: str, tmp_path: Path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    assert read_chat_template(str(path)) == read_chat_template(template) == template
    with pytest.raises(FileNotFoundError, match="no such file, and not a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    tok = load_tokenizer(stories_dir, str(path))
    chat = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat, tokenize=False) == "[user] Hi\n"
