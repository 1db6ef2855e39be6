"""Tool calling and structured outputs over HTTP on a real `pipeserve up` serving stories260K with
a chat template that renders tools (written here), driven by the official `openai` client.

`required` and a named function are valid calls by construction (arguments validated with
jsonschema); `auto` is read by each --tool-call-parser, the tiny model made to write exactly that
format by a regex constraint (structured_outputs); a tool result continues the conversation."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import Field

from pipeserve.local_cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Tools, assistant calls (arguments as objects: tojson) and tool results, rendered compactly: the
# model's context is 512 tokens.
TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}"
    "{% endif %}\n{% endfor %}assistant:"
)
WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
USER = [{"role": "user", "content": "Is it sunny?"}]
CITY = '"[a-z]{2,6}"'
# What each format's regex makes the model write (content before the calls where the format allows).
FORMATS = {
    "hermes": rf'Ok\. <tool_call>\{{"name": "weather", "arguments": \{{"city": {CITY}, "days": [1-9]\}}\}}'
              r"</tool_call>",
    "llama3_json": rf'\{{"name": "weather", "parameters": \{{"city": {CITY}, "days": [1-9]\}}\}}',
    "mistral": r"Ok\. \[TOOL_CALLS\]"
               rf'\[\{{"name": "weather", "arguments": \{{"city": {CITY}, "days": [1-9]\}}\}}\]',
    "pythonic": r'\[weather\(city="[a-z]{2,6}", days=[1-9]\)\]',
}
CONTENT = {"hermes": "Ok. ", "llama3_json": None, "mistral": "Ok. ", "pythonic": None}


@pytest.fixture(scope="module", params=list(FORMATS))  # one server per --tool-call-parser
def server(request, stories_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"tools-{request.param}")
    (directory / "template.jinja").write_text(TEMPLATE)
    flags = ["--chat-template", str(directory / "template.jinja"), "--enable-auto-tool-choice",
             "--tool-call-parser", request.param]
    with LocalCluster(directory / "server.log", stories_dir, *flags, workers=1, startup=180) as cluster:
        with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            yield request.param, c


Answer = tuple[str | None, list[tuple[str, str]], str]


def create(client: openai.OpenAI, stream: bool, **kwargs: Any) -> Answer:
    """(content, [(name, arguments)], finish_reason) of one chat call, streamed or not."""
    kwargs = {"model": "stories260K", "messages": USER, "max_tokens": 120, "temperature": 1.0, "seed": 7,
              **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        ids = [c.id for c in choice.message.tool_calls or ()]
        assert len(set(ids)) == len(ids) and all(ids)
        return choice.message.content, calls, choice.finish_reason
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    merged: dict[int, list[str]] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or ():
            if d.id:
                merged[d.index] = [d.function.name, ""]
            merged[d.index][1] += d.function.arguments or ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks) or None
    calls = [(n, a) for n, a in (merged[i] for i in sorted(merged))]
    return content, calls, chunks[-1].choices[0].finish_reason


def valid(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_auto_reads_the_parsers_format(server):
    parser, client = server
    regex = {"structured_outputs": {"regex": FORMATS[parser]}}
    whole = create(client, False, tools=[WEATHER, TIME], extra_body=regex)
    streamed = create(client, True, tools=[WEATHER, TIME], extra_body=regex)
    content, calls, finish = whole
    assert finish == "tool_calls" and [n for n, _ in calls] == ["weather"], whole
    assert content == CONTENT[parser]
    valid(calls)
    assert streamed == whole  # the same seed: the same text, read the same way


@pytest.mark.parametrize("server", ["hermes"], indirect=True)  # independent of the parser
def test_required_and_named_are_valid_calls_by_construction(server):
    _, client = server
    # One call (parallel calls off): this model, free to add calls, never ends the list on its own;
    # the constraint with parallel calls is checked in tests/test_openai_tools.py.
    whole = create(client, False, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert whole[0] is None and whole[2] == "tool_calls" and len(whole[1]) == 1, whole
    valid(whole[1])
    streamed = create(client, True, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert streamed == whole
    named = {"type": "function", "function": {"name": "time"}}
    whole = create(client, False, tools=[WEATHER, TIME], tool_choice=named)
    assert whole[0] is None and whole[2] == "stop" and [n for n, _ in whole[1]] == ["time"], whole
    valid(whole[1])
    assert create(client, True, tools=[WEATHER, TIME], tool_choice=named) == whole


@pytest.mark.parametrize("server", ["hermes"], indirect=True)  # independent of the parser
def test_a_tool_result_continues_the_conversation(server, stories_dir):
    _, client = server
    from transformers import AutoTokenizer

    first = client.chat.completions.create(model="stories260K", messages=USER, tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                           seed=1)
    call = first.choices[0].message.tool_calls[0]
    history = USER + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    out = client.chat.completions.create(model="stories260K", messages=history, tools=[WEATHER],
                                         tool_choice="none", max_tokens=8, temperature=0)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls
    # The server injects nothing: the prompt is the template's rendering, the call's arguments as an
    # object.
    tokenizer = AutoTokenizer.from_pretrained(stories_dir)
    rendered = [dict(m) for m in history]
    rendered[1]["tool_calls"] = [{"type": "function", "id": call.id, "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]
    text = tokenizer.apply_chat_template(rendered, tools=[WEATHER], chat_template=TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)
    assert f"{call.function.name} {{" in text and "tool: sunny" in text
    assert out.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    root = str(client.base_url).removesuffix("/v1/")
    tokens = httpx.post(root + "/tokenize", json={"messages": history, "tools": [WEATHER]}, timeout=60).json()
    assert tokens["count"] == out.usage.prompt_tokens  # /tokenize renders the same


@pytest.mark.parametrize("server", ["hermes"], indirect=True)  # independent of the parser
def test_structured_outputs_over_http(server):
    _, client = server
    out = client.chat.completions.create(model="stories260K", messages=USER, max_tokens=20,
                                         extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].message.content in ("yes", "no")
    out = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=30,
                                    extra_body={"structured_outputs": {"json": SCHEMAS["time"]}})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMAS["time"])


@pytest.mark.parametrize("server", ["hermes"], indirect=True)
def test_responses_text_stream_and_function_call_round_trip(server):
    _, client = server
    out = client.responses.create(model="stories260K", input="Is it sunny?", instructions="Answer.",
                                  max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model="stories260K", max_tokens=12, temperature=0,
                                          messages=[{"role": "system", "content": "Answer."}, *USER])
    assert out.output_text == chat.choices[0].message.content  # rendered as chat renders it
    assert out.usage.input_tokens == chat.usage.prompt_tokens and out.status == "incomplete"
    events = list(client.responses.create(model="stories260K", input="Is it sunny?", instructions="Answer.",
                                          max_output_tokens=12, temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text
    tool = {"type": "function", "name": "weather", "parameters": WEATHER["function"]["parameters"]}
    first = client.responses.create(model="stories260K", input="Is it sunny?", tools=[tool],
                                    tool_choice="required", parallel_tool_calls=False, extra_body={"seed": 3})
    (call,) = first.output
    assert call.type == "function_call" and call.name == "weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["weather"])
    streamed = list(client.responses.create(model="stories260K", input="Is it sunny?", tools=[tool],
                                            tool_choice="required", parallel_tool_calls=False,
                                            extra_body={"seed": 3},
                                            stream=True))
    assert "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta") == (
        call.arguments)
    history = [{"role": "user", "content": "Is it sunny?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    answer = client.responses.create(model="stories260K", input=history, tools=[tool], tool_choice="none",
                                     max_output_tokens=8, temperature=0)
    assert answer.output_text and answer.output[0].type == "message"


@pytest.mark.parametrize("server", ["hermes"], indirect=True)
def test_openai_agents_sdk_runs_one_turn_with_a_function_tool(server):
    agents = pytest.importorskip("agents")
    _, client = server
    called: list[dict[str, Any]] = []

    # Bounded arguments: a tiny model writes a free string until max_tokens.
    @agents.function_tool
    def weather(city: Literal["paris", "rome"], days: Annotated[int, Field(ge=1, le=9)]) -> str:
        """The weather in a city."""
        called.append({"city": city, "days": days})
        return "sunny"

    agents.set_tracing_disabled(True)  # no trace export to OpenAI
    model = agents.OpenAIResponsesModel(
        model="stories260K", openai_client=openai.AsyncOpenAI(base_url=str(client.base_url), api_key="x"))
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    # The tool's result is the turn's answer: this model, asked again, would only ramble to max_tokens.
    agent = agents.Agent(name="forecaster", instructions="Use the tool.", tools=[weather], model=model,
                         model_settings=settings, tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "Is it sunny?", max_turns=2)
    assert len(called) == 1 and called[0]["city"] in ("paris", "rome") and 1 <= called[0]["days"] <= 9
    assert result.final_output == "sunny"
