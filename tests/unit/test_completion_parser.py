"""elasticctl's shell completion, as described from its own parser, and its --help: every
command has a help line, and each fits on one line."""

from __future__ import annotations

import argparse
import io
import re
from contextlib import redirect_stdout

import pytest

from elasticctl import cli, completion


@pytest.fixture(scope="module")
def line() -> completion.CommandLine:
    return completion.describe(cli.build_parser({}))


def subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_every_subcommand_has_a_help_line():
    commands = subparsers(cli.build_parser({}))
    helped = {action.dest: action.help for action in commands._choices_actions}
    primary = {name for name, sub in commands.choices.items() if sub.prog.endswith(" " + name)}
    assert primary == set(helped)  # an alias (ps) shares its command's line
    assert all(helped[name] and helped[name].strip() == helped[name] for name in primary), helped


def test_elasticctl_help_lists_every_command_on_one_line(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        cli.build_parser({}).parse_args(["--help"])
    block = out.getvalue().split("  COMMAND\n", 1)[1].split("\n\n", 1)[0].splitlines()
    shown = [re.match(r"^    (\S+)(?: \((\S+)\))? +\S", row) for row in block]
    assert all(shown), f"a command's help is not on one line:\n{out.getvalue()}"
    listed = {m.group(1) for m in shown} | {m.group(2) for m in shown if m.group(2)}
    assert listed == set(subparsers(cli.build_parser({})).choices)
    assert "completion" in listed


def test_the_commands_and_their_aliases(line):
    names = [command.names for command in line.commands]
    assert ("list", "ps") in names and ("completion",) in names
    assert [n for command in line.commands for n in command.names] == list(
        subparsers(cli.build_parser({})).choices
    )
    assert all(command.help for command in line.commands)


def command(line: completion.CommandLine, name: str) -> completion.Command:
    return next(c for c in line.commands if name in c.names)


def option(owner: completion.Command | completion.CommandLine, name: str) -> completion.Option:
    return next(o for o in owner.options if name in o.names + o.aliases)


def test_torchrun_spellings_are_understood_not_offered(line):
    submit = command(line, "submit")
    offered = [name for o in submit.options for name in o.names]
    assert "--nproc-per-node" in offered and "--join-timeout" in offered
    assert not [name for name in offered if "_" in name]
    assert option(submit, "--nproc_per_node").names == ("--nproc-per-node",)
    assert option(submit, "--join_timeout").aliases == ("--join_timeout",)


def test_what_values_and_operands_are(line):
    submit = command(line, "submit")
    assert option(submit, "--workdir").value == completion.DIRS
    assert option(submit, "--python").value == completion.FILES
    assert option(submit, "--log-dir").value == completion.DIRS
    assert option(submit, "--start-method").value == "spawn fork forkserver"
    assert option(submit, "--nnodes").value == completion.ANY
    assert option(submit, "--wait").value is None and option(submit, "--env").repeatable
    assert option(line, "--socket").value == completion.FILES
    assert (submit.operand, submit.operand_name, submit.remainder) == (
        completion.FILES,
        "script",
        True,
    )
    assert command(line, "status").operand == completion.ALL_JOBS
    assert command(line, "logs").operand == completion.ALL_JOBS
    assert command(line, "cancel").operand == completion.JOBS  # only jobs that can be cancelled
    assert command(line, "drain").operand == completion.NODES
    assert command(line, "completion").operand == "bash zsh"
    assert command(line, "version").operand is None and not command(line, "list").remainder


def test_one_line():
    assert completion.one_line("a  b\n c") == "a b c"
    cut = completion.one_line("word " * 30, width=20)
    assert cut == "word word word word..." and len(cut) <= 23


def test_the_bash_script_tables(line):
    text = completion.bash(line)
    assert text.startswith("# bash completion for elasticctl")
    assert "['submit --nproc_per_node']=@any" in text  # understood, so its value is skipped
    assert "[cancel]=@jobs" in text and "[completion]='bash zsh'" in text
    assert (
        "declare -gA _elasticctl_options=(" in text
    )  # -g: bash-completion sources it in a function
    assert text.rstrip().endswith("complete -F _elasticctl elasticctl")


def test_the_zsh_script(line):
    text = completion.zsh(line)
    assert text.startswith("#compdef elasticctl\n") and text.rstrip().endswith('_elasticctl "$@"')
    assert "'!(--nproc-per-node --nproc_per_node)--nproc_per_node=[" in text
    assert "'1:job:{_elasticctl_list @jobs}'" in text and "'1:shell:(bash zsh)'" in text
    assert "'*--env=[" in text  # repeatable


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_elasticctl_completion_prints_the_script(shell, capsys):
    assert cli.main(["completion", shell]) == 0
    assert capsys.readouterr().out == completion.script(
        shell, completion.describe(cli.build_parser({}))
    )


def test_the_kinds_of_action_are_argparse_own():
    """Learned from a parser made with public calls: the same classes argparse uses."""
    parser = argparse.ArgumentParser()
    assert isinstance(parser.add_subparsers(), completion._SUBCOMMANDS)
    for kind in ("append", "extend", "count"):
        assert isinstance(parser.add_argument(f"--{kind}", action=kind), completion._REPEATABLE)
    assert not isinstance(parser.add_argument("--one"), completion._REPEATABLE)


def _without_actions(parser: argparse.ArgumentParser) -> None:
    del parser._actions


def _actions_as_tuple(parser: argparse.ArgumentParser) -> None:
    parser._actions = tuple(parser._actions)


def _without_help_lines(parser: argparse.ArgumentParser) -> None:
    del subparsers(parser)._choices_actions


def _help_lines_elsewhere(parser: argparse.ArgumentParser) -> None:
    subparsers(parser)._choices_actions = {"submit": "a help line"}


def _a_command_without_actions(parser: argparse.ArgumentParser) -> None:
    del subparsers(parser).choices["submit"]._actions


@pytest.mark.parametrize(
    "change",
    [
        _without_actions,
        _actions_as_tuple,
        _without_help_lines,
        _help_lines_elsewhere,
        _a_command_without_actions,
    ],
)
def test_an_argparse_that_keeps_its_parsers_otherwise_fails_loudly(change, monkeypatch, capsys):
    """What a Python whose argparse changed shape would do: not a script that completes
    nothing, and no traceback either: elasticctl says what it cannot read, and fails."""
    parser = cli.build_parser({})
    change(parser)
    with pytest.raises(completion.ArgparseChanged, match="argparse changed"):
        completion.describe(parser)

    described = completion.describe

    def describe_changed(parser: argparse.ArgumentParser) -> completion.CommandLine:
        change(parser)  # the parser that `elasticctl completion` reads back
        return described(parser)

    monkeypatch.setattr(completion, "describe", describe_changed)
    assert cli.main(["completion", "bash"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and "cannot read elasticctl's options back" in out.err
    assert "Traceback" not in out.err


def test_no_command_help_shows_a_stray_backslash(monkeypatch):
    """A help text written as \"\"\"\\\\ (an escaped backslash, not a line continuation)
    started `elasticctl usage --help` with a backslash."""
    monkeypatch.setenv("COLUMNS", "100")
    for name in subparsers(cli.build_parser({})).choices:
        out = io.StringIO()
        with redirect_stdout(out), pytest.raises(SystemExit):
            cli.build_parser({}).parse_args([name, "--help"])
        stray = [line for line in out.getvalue().splitlines() if line.lstrip().startswith("\\")]
        assert not stray, f"elasticctl {name} --help:\n{out.getvalue()}"
