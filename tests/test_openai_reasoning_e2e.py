"""--reasoning-parser on a real `pipeserve up` serving stories260K (the official `openai` client).
The tiny model never writes `</think>` on its own, so this checks what a real engine does with what
it does write (the exact split of model text is tests/test_openai_reasoning.py's): deepseek_r1
reads an unclosed section as all reasoning, streamed or not; a constraint under deepseek_r1 leaves
the reasoning free (the engine runs the combined grammar); under qwen3, whose section is optional,
the constrained answer is content."""

from __future__ import annotations

import re
from typing import Any

import openai
import pytest

from pipeserve.local_cluster import LocalCluster
from tests.test_openai_tools_e2e import TEMPLATE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

USER = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def server(request, stories_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"reasoning-{request.param}")
    (directory / "template.jinja").write_text(TEMPLATE)
    flags = ["--chat-template", str(directory / "template.jinja"), "--reasoning-parser", request.param]
    with LocalCluster(directory / "server.log", stories_dir, *flags, workers=1, startup=180) as cluster:
        with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            yield request.param, c


def split(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str | None, str | None, str]:
    kwargs = {"model": "stories260K", "messages": USER, "max_tokens": 24, "temperature": 0, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.reasoning_content == choice.message.reasoning
        return choice.message.reasoning, choice.message.content, choice.finish_reason
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    return reasoning or None, content or None, chunks[-1].choices[0].finish_reason


def test_plain_output(server):
    parser, client = server
    whole = split(client, False)
    assert split(client, True) == whole
    reasoning, content, _ = whole
    if parser == "deepseek_r1":  # no </think>: everything is reasoning
        assert reasoning and content is None
    else:  # no <think>: everything is content
        assert reasoning is None and content


def test_a_constraint_applies_after_the_reasoning(server):
    parser, client = server
    regex = {"structured_outputs": {"regex": "[a-z]{3,8}"}}
    whole = split(client, False, extra_body=regex)
    assert split(client, True, extra_body=regex) == whole
    reasoning, content, finish = whole
    if parser == "deepseek_r1":  # the section is free text until </think>, which this model never writes
        assert reasoning and "</think>" not in reasoning and content is None and finish == "length"
    else:
        assert reasoning is None and re.fullmatch("[a-z]{3,8}", content or ""), whole
