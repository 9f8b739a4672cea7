"""The commands that README.md and docs/*.md show run as written: each `quantlab ...` in a fenced shell block names
a real subcommand with options it takes (parsed by quantlab's own click command tree, never run), and each repo
path a command names exists. README's test command is the one CI runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer.main

from quantlab.cli import app

try:  # typer builds its commands on a click of its own
    from typer._click.exceptions import ClickException, UsageError
except ImportError:
    from click.exceptions import ClickException, UsageError

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
REPO_PATH = re.compile(r"^(?:recipes|benchmarks|scripts|evals|docs)/")
OPERATORS = {"&&", "||", ";", "|", "&"}
PREFIXES = {"setsid", "nohup", "time", "/usr/bin/time", "exec"}


def shell_commands(text: str) -> list[list[str]]:
    """Every simple command of the fenced shell blocks: continuation lines joined, comments dropped, split at
    `&&`, `||`, `;`, `|` and `&`; a console block's `$ ` prompt removed."""
    commands = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.removeprefix("$ ").strip()
            if not line or line.startswith("#"):
                continue
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            command: list[str] = []
            for token in lexer:
                if token in OPERATORS:
                    commands.append(command)
                    command = []
                else:
                    command.append(token)
            commands.append(command)
    return [command for command in commands if command]


def quantlab_arguments(command: list[str]) -> list[str] | None:
    """The arguments after `quantlab` (or `python -m quantlab`), past `VAR=value` and wrappers such as setsid;
    None when the command is not quantlab's."""
    words = list(command)
    while words and (words[0] in PREFIXES or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])):
        words.pop(0)
    if words[:1] == ["quantlab"]:
        return words[1:]
    if len(words) >= 3 and words[0].split("/")[-1].startswith("python") and words[1:3] == ["-m", "quantlab"]:
        return words[3:]
    return None


def documented() -> list[tuple[str, list[str]]]:
    return [
        (path.relative_to(REPO).as_posix(), command) for path in DOCS for command in shell_commands(path.read_text())
    ]


def parse(arguments: list[str]) -> None:
    """Resolve the subcommand through the app's click command tree and parse its options and arguments as click does
    before running it (unknown subcommand or option, missing argument, bad value: click's error); nothing runs."""
    command = typer.main.get_command(app)
    context = None
    words = list(arguments)
    while hasattr(command, "list_commands"):  # a group
        context = command.context_class(command, info_name=command.name, parent=context)
        if not words or words[0].startswith("-"):
            raise UsageError(f"no subcommand in {arguments}; known: {', '.join(command.list_commands(context))}")
        name = words.pop(0)
        sub = command.get_command(context, name)
        if sub is None:
            raise UsageError(f"no such command {name!r}; known: {', '.join(command.list_commands(context))}")
        command = sub
    if "--help" not in words:
        command.make_context(command.name, words, parent=context)


def test_the_docs_show_commands():
    commands = documented()
    assert sum(quantlab_arguments(c) is not None for _, c in commands) >= 20, commands
    assert {path for path, _ in commands} >= {"README.md", "docs/serving.md", "docs/ray.md"}


@pytest.mark.parametrize(
    "where, command",
    [(where, command) for where, command in documented() if quantlab_arguments(command) is not None],
    ids=lambda value: value if isinstance(value, str) else " ".join(value)[:80],
)
def test_quantlab_command_parses(where, command):
    try:
        parse(quantlab_arguments(command))
    except ClickException as error:
        pytest.fail(f"{where}: `{shlex.join(command)}`: {error.format_message()}")


def test_paths_in_commands_exist():
    missing = [
        f"{where}: {word}"
        for where, command in documented()
        for word in command
        for path in [word.split("=", 1)[-1]]
        if REPO_PATH.match(path) and not (REPO / path).exists()
    ]
    assert not missing


def test_a_wrong_command_is_caught():
    """The parser above refuses what a reader could not run."""
    for wrong in (["sweeep", "recipes/smollm2-135m.yaml"], ["sweep", "--nope", "x"], ["pick", "--max-kld", "lots"]):
        with pytest.raises(ClickException):
            parse(wrong)
    with pytest.raises(ClickException):
        parse(["sweep"])  # its RECIPE is required
    parse(["cache", "prune", "--older-than", "30", "--dry-run"])
    assert shell_commands("```bash\nA=1 quantlab ui # note\n```\n") == [["A=1", "quantlab", "ui"]]


def test_readme_test_command_is_the_one_ci_runs():
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (REPO / "README.md").read_text()
    assert f"```bash\n{ci}\n```" in readme
