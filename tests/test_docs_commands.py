"""Every `pipeserve` command and flag that README.md and docs/*.md name exists: each command line in
their code (inline spans and fenced blocks) is parsed into its subcommand and flags, and each flag is
looked up in that subcommand's `--help`; a flag named on its own (`--kv-cache-gb`) must belong to
some pipeserve command."""

from __future__ import annotations

import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from pipeserve import cli
from pipeserve.bench.step import SYSTEMS as STEP_SYSTEMS
from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
PLACEHOLDERS = ("...", "COMMAND", "NAME")  # `pipeserve bench NAME --help`


def code_of(text: str) -> list[str]:
    """The code of a markdown text: each line of its fenced blocks, and each inline span."""
    out: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out.append(line)
        else:
            out += re.findall(r"`([^`]+)`", line)
    return out


def commands_in(code: str) -> list[list[str]]:
    """The pipeserve command lines of a piece of code, as argv after `pipeserve` (comments dropped)."""
    code = code.split(" #")[0].replace("\\", " ")
    found = []
    for part in re.split(r"&&|\|\||;|\|", code):
        try:
            words = shlex.split(part)
        except ValueError:  # an unbalanced quote in a shortened example
            words = part.split()
        for i, word in enumerate(words):
            # The executable (not `pipeserve[bench]`, `from pipeserve import`, `docker build -t pipeserve`).
            if (word == "pipeserve" or word.endswith("/bin/pipeserve")) and (i == 0 or words[i - 1] not in (
                    "from", "import", "-t", "--tag")):
                found.append(words[i + 1:])
                break
    return found


@cache
def help_flags(table_name: str, name: str) -> frozenset[str]:
    bench = table_name == "bench"
    table, prog = (cli.BENCH_COMMANDS, "pipeserve bench") if bench else (cli.COMMANDS, "pipeserve")
    parser = cli.build_parser(table, prog, name)
    return frozenset(s for action in parser._actions for s in action.option_strings)


@cache
def every_flag() -> frozenset[str]:
    flags: set[str] = set()
    for name in cli.COMMANDS:
        if cli.COMMANDS[name][0]:
            flags |= help_flags("top", name)
    for name in cli.BENCH_COMMANDS:
        flags |= help_flags("bench", name)
    return frozenset(flags)


def named_commands() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(doc, table, subcommand, flags) for every pipeserve command line in the docs."""
    out = []
    for doc in DOCS:
        for code in code_of(doc.read_text()):
            for argv in commands_in(code):
                # Not a command line: an error message ("pipeserve engine: error: ..."), a placeholder,
                # a benchmark's system name (`pipeserve compiled` in bench step's tables).
                if (not argv or argv[0].startswith("-") or argv[0].endswith(":")
                        or argv[0] in PLACEHOLDERS or f"pipeserve {argv[0]}" in STEP_SYSTEMS):
                    continue
                table, rest = ("bench", argv[1:]) if argv[0] == "bench" else ("top", argv)
                if not rest or rest[0].startswith("-") or rest[0] in PLACEHOLDERS:  # `bench --help`
                    continue
                flags = tuple(sorted({m.split("=")[0] for w in rest[1:] for m in FLAG.findall(w)
                                      if w.startswith("--")}))
                out.append((doc.name, table, rest[0], flags))
    return out


def lone_flags() -> list[tuple[str, str]]:
    """(doc, flag) for every code span that is a flag of no named tool (`--kv-cache-gb`, `--batch 1 8`)
    and that no other tool's command line in the docs shows (`--build-arg` of `docker build`)."""
    out, others = [], set()
    for doc in DOCS:
        for code in code_of(doc.read_text()):
            words = code.split()
            if words and words[0].startswith("--") and FLAG.fullmatch(words[0].split("=")[0]):
                out.append((doc.name, words[0].split("=")[0]))
            elif words and not commands_in(code):
                others.update(FLAG.findall(code))
    return [(doc, flag) for doc, flag in out if flag not in others]


NAMED = named_commands()
LONE = lone_flags()


def test_the_docs_name_commands_and_flags() -> None:
    assert len(NAMED) > 50 and len(LONE) > 50
    assert {"serve", "up", "generate"} <= {name for _, table, name, _ in NAMED if table == "top"}


@pytest.mark.parametrize(("doc", "table", "name", "flags"), NAMED,
                         ids=[f"{d}: {t} {n} {' '.join(f)}" for d, t, n, f in NAMED])
def test_every_command_line_in_the_docs_parses(doc: str, table: str, name: str,
                                               flags: tuple[str, ...]) -> None:
    command = f"pipeserve {'bench ' * (table == 'bench')}{name}"
    assert name in (cli.BENCH_COMMANDS if table == "bench" else cli.COMMANDS), f"{doc}: no `{command}`"
    unknown = set(flags) - help_flags(table, name)
    assert not unknown, f"{doc}: `{command}` has no {sorted(unknown)}"


@pytest.mark.parametrize(("doc", "flag"), sorted(set(LONE)), ids=[f"{d}: {f}" for d, f in sorted(set(LONE))])
def test_every_flag_named_alone_belongs_to_a_command(doc: str, flag: str) -> None:
    assert flag in every_flag(), f"{doc} names {flag}, which no pipeserve command has"


def test_other_tools_are_not_taken_for_pipeserve() -> None:
    assert commands_in("pip install 'pipeserve[bench]'") == []
    assert commands_in("pipeserve up --port 1 && pipeserve generate hi --json") == [
        ["up", "--port", "1"], ["generate", "hi", "--json"]]


def test_docs_exist() -> None:
    assert all(Path(doc).is_file() for doc in DOCS) and len(DOCS) > 5
