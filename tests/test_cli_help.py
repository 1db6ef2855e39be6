"""Every flag of every command says what it does, its choices and its default, generated from the one
config definition (pipeserve/config.py opt()); `--version` everywhere."""

from __future__ import annotations

import argparse
import contextlib
import io
from dataclasses import fields

import pytest

from pipeserve import cli
from pipeserve.config import Addresses, EngineConfig, GatewayConfig
from pipeserve.sampling_params import SamplingParams

TABLES = [(cli.COMMANDS, "pipeserve"), (cli.BENCH_COMMANDS, "pipeserve bench")]
COMMANDS = [(table, prog, name) for table, prog in TABLES for name in table if table[name][0]]


@pytest.mark.parametrize("cls", [EngineConfig, GatewayConfig, Addresses, SamplingParams])
def test_every_config_field_has_help(cls: type) -> None:
    """A field added without opt(default, "what it does") fails here."""
    missing = [f.name for f in fields(cls) if not f.metadata.get("help")]
    assert not missing, f"{cls.__name__} fields without help: {missing}"


@pytest.mark.parametrize(("table", "prog", "name"), COMMANDS, ids=[f"{p} {n}" for _, p, n in COMMANDS])
def test_every_flag_is_described(table: dict, prog: str, name: str) -> None:
    parser = cli.build_parser(table, prog, name)
    bare = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        text = (action.help or "").strip()
        if not text or text.startswith("(default"):
            bare.append(action.option_strings[0] if action.option_strings else action.dest)
    assert not bare, f"{prog} {name}: flags without a description: {bare}"


def test_help_shows_choices_and_defaults() -> None:
    text = cli.build_parser(cli.COMMANDS, "pipeserve", "up").format_help()
    assert "{auto,reference,cpu,torch,triton}" in text
    assert "(default: optimistic)" in text and "(default: 50051)" in text and "(default: 2)" in text
    engine = cli.build_parser(cli.COMMANDS, "pipeserve", "engine")
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
        engine.parse_args(["--backend", "cuda"])
    assert "invalid choice: 'cuda'" in err.getvalue()
    generate = cli.build_parser(cli.COMMANDS, "pipeserve", "generate").format_help()
    assert "generation_config.json" in generate and "0 is greedy (default: 1.0)" in generate


def test_config_choices_are_checked_once_for_every_caller() -> None:
    with pytest.raises(ValueError, match="admission must be one of max, optimistic, predicted; got 'x'"):
        EngineConfig(admission="x")
    with pytest.raises(ValueError, match="generation_config must be one of auto, none"):
        EngineConfig(generation_config="vllm")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("pipeserve ")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("pipeserve ")
