"""lm-evaluation-harness's `local-chat-completions` against a real `pipeserve up` serving stories260K
with a chat template agrees with lm-eval's own `hf` model on the same checkpoint rendered through the
same template (`apply_chat_template`). lm-eval's chat models answer generate_until tasks only (they
refuse loglikelihood), so the task is a greedy generation."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeserve.local_cluster import LocalCluster
from tests.test_openai_e2e import LM_EVAL_SEEDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The template writes BOS itself: the server encodes the rendering without adding special tokens, and
# lm-eval's hf model does the same for a string that starts with BOS.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")

CONTEXTS = [
    "Tom had a red ball. He liked to",
    "Lily went to the park. She saw a big",
    "The sun was hot. The children wanted to",
    "Once upon a time there was a little",
    "Sam and his mom went to the store to buy",
]


@pytest.fixture(scope="module")
def checkpoint(stories_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stories260K with the template in its tokenizer_config.json, where both the server and
    transformers read it."""
    root = tmp_path_factory.mktemp("chat-checkpoint") / "stories-chat"
    shutil.copytree(stories_dir, root)
    config = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return root


@pytest.fixture(scope="module")
def cluster(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log = tmp_path_factory.mktemp("chat-server") / "server.log"
    with LocalCluster(log, str(checkpoint), "--served-model-name", "stories-chat", workers=1,
                      startup=120) as srv:
        yield srv


def write_task(directory: Path) -> None:
    (directory / "gen.jsonl").write_text("".join(json.dumps({"context": c, "target": "x"}) + "\n"
                                                 for c in CONTEXTS))
    (directory / "stories_chat_gen.yaml").write_text(
        f"task: stories_chat_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {directory / 'gen.jsonl'}\ntest_split: test\ndoc_to_text: '{{{{context}}}}'\n"
        "output_type: generate_until\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )


def test_lm_eval_local_chat_completions_equals_hf(checkpoint: Path, cluster: LocalCluster,
                                                   tmp_path: Path) -> None:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    write_task(tmp_path)
    common = {
        "tasks": ["stories_chat_gen"],
        "task_manager": TaskManager(include_path=str(tmp_path)),
        "apply_chat_template": True,
        "log_samples": True,
        **LM_EVAL_SEEDS,
    }
    served = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args=f"model=stories-chat,base_url={cluster.http_url}/v1/chat/completions,num_concurrent=1,"
        "max_retries=1",
        **common,
    )
    local = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={checkpoint},dtype=float32",
                                   device="cpu", **common)

    def samples(run: dict) -> list[dict]:
        return sorted(run["samples"]["stories_chat_gen"], key=lambda s: s["doc_id"])

    ours, theirs = samples(served), samples(local)
    assert len(ours) == len(theirs) == len(CONTEXTS)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    for a, b in zip(ours, theirs, strict=True):
        # The messages lm-eval sent the server render, by the checkpoint's template, to exactly the
        # prompt its hf model ran.
        messages = json.loads(a["arguments"][0][0][0])
        assert messages == [{"role": "user", "content": a["doc"]["context"]}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == b["arguments"][0][0] == f"<s>user: {a['doc']['context']}\nassistant:"
        # The same greedy text; `hf` decodes the continuation's ids alone, where SentencePiece drops
        # a leading space that the server's text keeps.
        assert a["resps"][0][0].strip() == b["resps"][0][0].strip()
    assert (served["results"]["stories_chat_gen"]["exact_match,none"]
            == local["results"]["stories_chat_gen"]["exact_match,none"])
    texts = [s["resps"][0][0].strip() for s in ours]
    assert sum(bool(t) for t in texts) >= 3, texts  # the model wrote something worth comparing
