"""Shell completion for elasticctl, generated from its own argparse parsers.

``elasticctl completion bash`` and ``elasticctl completion zsh`` print the scripts that a
package installs as /usr/share/bash-completion/completions/elasticctl and
/usr/share/zsh/vendor-completions/_elasticctl.  They complete the commands, each command's
options (torchrun's underscore spellings are understood, not offered) and what some of them
take: files, directories, choices, and job ids or node names, which the script asks the
daemon for with ``elasticctl completion --words jobs`` (a ``list`` request whose ids it
prints, one a line; nothing when the daemon does not answer within 2 seconds).

Pure: a parser in, a description of the command line (``describe``), a script out.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from typing import Any

from elasticctl.client import ClientError

# What a value or an operand is: one of these, or the choices themselves ("bash zsh").
FILES, DIRS, ANY = "@files", "@dirs", "@any"
JOBS, ALL_JOBS, NODES = "@jobs", "@all-jobs", "@nodes"  # asked of the daemon

OPERANDS = {"job": ALL_JOBS, "node": NODES, "script": FILES}  # by the positional's dest
ACTIVE_JOBS_ONLY = {"cancel"}  # commands whose JOB is one that has not ended
FILE_METAVARS, DIR_METAVARS = {"PATH", "FILE"}, {"DIR"}
PROGRAM = "elasticctl"


@dataclass(frozen=True)
class Option:
    names: tuple[str, ...]  # offered
    aliases: tuple[str, ...]  # accepted, not offered (torchrun's --long_name spellings)
    help: str
    value: str | None  # None: a switch; else FILES, DIRS, ANY or the choices
    metavar: str
    repeatable: bool


@dataclass(frozen=True)
class Command:
    names: tuple[str, ...]  # the name, then its aliases
    help: str
    options: tuple[Option, ...]
    operand: str | None  # what its positionals are (as Option.value), or none
    operand_name: str  # the first positional's, e.g. "job"
    remainder: bool  # torchrun's rule: what follows the first operand is the script's


@dataclass(frozen=True)
class CommandLine:
    options: tuple[Option, ...]
    commands: tuple[Command, ...]


# -- reading a parser back ------------------------------------------------------------------
#
# argparse has no public way to list a parser's actions or its commands' help lines: these two
# private attributes are read here, and only here, each checked for the shape it has had from
# Python 3.11 on (tests/unit/test_completion_parser.py).  Were a Python to change either, the
# completion command says so and fails, rather than print a script that completes nothing.
# The kinds of action (subcommands, append, extend, count) are learned from a parser made
# with argparse's public calls, not from its private class names.


class ArgparseChanged(ClientError):
    """This Python's argparse keeps a parser's actions otherwise than this module reads them."""

    code = "unsupported"

    def __init__(self, what: str) -> None:
        super().__init__(
            f"cannot read elasticctl's options back for completion: {what} "
            "(argparse changed in this Python; please report it)"
        )


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    actions = getattr(parser, "_actions", None)
    if not isinstance(actions, list) or not all(isinstance(a, argparse.Action) for a in actions):
        raise ArgparseChanged("ArgumentParser._actions is no list of actions")
    return actions


def _kinds() -> tuple[type[argparse.Action], tuple[type[argparse.Action], ...]]:
    """The class of a subcommands action, and those of the repeatable options."""
    probe = argparse.ArgumentParser(add_help=False)
    subcommands = type(probe.add_subparsers())
    repeatable = tuple(
        type(probe.add_argument(f"--{kind}", action=kind)) for kind in ("append", "extend", "count")
    )
    return subcommands, repeatable


_SUBCOMMANDS, _REPEATABLE = _kinds()


def _subcommands(parser: argparse.ArgumentParser) -> tuple[dict[str, Any], dict[str, str]]:
    """Each command's parser by name (aliases too), and each command's help line."""
    found = [a for a in _actions(parser) if isinstance(a, _SUBCOMMANDS)]
    if len(found) != 1:
        raise ArgparseChanged(f"{len(found)} subcommand actions where there is one")
    commands, helped = found[0].choices, getattr(found[0], "_choices_actions", None)
    if not isinstance(commands, dict) or not all(
        isinstance(p, argparse.ArgumentParser) for p in commands.values()
    ):
        raise ArgparseChanged("the subcommands' choices are no map of parsers")
    if not isinstance(helped, list) or not all(
        isinstance(getattr(a, "dest", None), str) and isinstance(a, argparse.Action) for a in helped
    ):
        raise ArgparseChanged("the subcommands keep their help lines elsewhere")
    return commands, {action.dest: action.help or "" for action in helped}


# -- the parser, described ------------------------------------------------------------------


def describe(parser: argparse.ArgumentParser) -> CommandLine:
    """The command line that ``parser`` takes: ArgparseChanged if it cannot be read back."""
    choices, helps = _subcommands(parser)
    names: dict[int, list[str]] = {}  # a command's parser -> its name and aliases
    parsers: dict[int, argparse.ArgumentParser] = {}
    for name, sub in choices.items():
        names.setdefault(id(sub), []).append(name)
        parsers[id(sub)] = sub
    commands = tuple(
        _command(tuple(given), helps.get(given[0], ""), parsers[key])
        for key, given in names.items()
    )
    return CommandLine(options(parser), commands)


def _command(names: tuple[str, ...], help: str, parser: argparse.ArgumentParser) -> Command:
    positionals = [a for a in _actions(parser) if not a.option_strings]
    operand, operand_name = None, ""
    if positionals:
        first = positionals[0]
        operand = " ".join(first.choices) if first.choices else OPERANDS.get(first.dest)
        if operand == ALL_JOBS and names[0] in ACTIVE_JOBS_ONLY:
            operand = JOBS
        operand_name = str(first.metavar or first.dest).lower()
    remainder = any(a.nargs == argparse.REMAINDER for a in positionals)
    return Command(names, one_line(help), options(parser), operand, operand_name, remainder)


def options(parser: argparse.ArgumentParser) -> tuple[Option, ...]:
    """The parser's options; a hidden one that spells a visible one with underscores is
    folded into it as an alias."""
    actions = [a for a in _actions(parser) if a.option_strings]
    visible = [a for a in actions if a.help != argparse.SUPPRESS]
    hidden = [a for a in actions if a.help == argparse.SUPPRESS]
    twins = {name.replace("_", "-"): action for action in visible for name in action.option_strings}
    folded: dict[int, list[str]] = {id(a): [] for a in visible}
    found = []
    for action in hidden:
        twin = twins.get(action.option_strings[0].replace("_", "-"))
        if twin is not None:
            folded[id(twin)].extend(action.option_strings)
        else:
            found.append(_option(action, shown=False))
    return tuple([_option(a, extra=tuple(folded[id(a)])) for a in visible] + found)


def _option(action: argparse.Action, shown: bool = True, extra: tuple[str, ...] = ()) -> Option:
    strings = action.option_strings
    underscored = {s for s in strings if "_" in s and s.replace("_", "-") in strings}
    names = tuple(s for s in strings if s not in underscored) if shown else ()
    aliases = tuple(s for s in strings if s not in names) + extra
    repeatable = isinstance(action, _REPEATABLE)
    metavar = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
    return Option(
        names, aliases, one_line(action.help if shown else ""), _value(action), metavar, repeatable
    )


def _value(action: argparse.Action) -> str | None:
    if action.nargs == 0:
        return None
    if action.choices:
        return " ".join(str(choice) for choice in action.choices)
    if action.metavar in FILE_METAVARS:
        return FILES
    if action.metavar in DIR_METAVARS:
        return DIRS
    return ANY


def one_line(text: str | None, width: int = 72) -> str:
    """The help text on one line, cut at a word before ``width``."""
    text = " ".join((text or "").split()).replace("%%", "%")
    if len(text) <= width:
        return text
    return text[:width].rsplit(" ", 1)[0].rstrip(",;:(") + "..."


def script(shell: str, line: CommandLine) -> str:
    return {"bash": bash, "zsh": zsh}[shell](line)


# -- bash -----------------------------------------------------------------------------------


def bash(line: CommandLine) -> str:
    """A bash completion script: the tables, generated; the function that reads them, fixed."""
    offered = {PROGRAM: _offered(line.options)}  # keyed by the command, or PROGRAM before one
    values = {
        f"{PROGRAM} {name}": o.value
        for o in line.options
        for name in o.names + o.aliases
        if o.value is not None
    }
    operands, remainders = {}, []
    for command in line.commands:
        for name in command.names:
            offered[name] = _offered(command.options)
            values.update(
                {
                    f"{name} {option}": o.value
                    for o in command.options
                    for option in o.names + o.aliases
                    if o.value is not None
                }
            )
            if command.operand:
                operands[name] = command.operand
            if command.remainder:
                remainders.append(name)
    commands = " ".join(name for command in line.commands for name in command.names)
    return (
        BASH_HEAD
        + "\n".join(
            [
                f"_elasticctl_commands={shlex.quote(commands)}",
                _bash_table("_elasticctl_options", offered),
                _bash_table("_elasticctl_values", values),
                _bash_table("_elasticctl_operands", operands),
                _bash_table("_elasticctl_remainder", {name: "1" for name in remainders}),
            ]
        )
        + "\n"
        + BASH_BODY
    )


def _offered(options: tuple[Option, ...]) -> str:
    return " ".join(name for option in options for name in option.names)


def _bash_table(name: str, table: dict[str, str]) -> str:
    rows = "".join(
        f"\n    [{shlex.quote(key)}]={shlex.quote(value)}" for key, value in table.items()
    )
    return f"declare -gA {name}=({rows}\n)"


BASH_HEAD = """\
# bash completion for elasticctl                          -*- shell-script -*-
# Generated by `elasticctl completion bash` from elasticctl's own parser: install it as
# /usr/share/bash-completion/completions/elasticctl, or source it from ~/.bashrc.

"""

BASH_BODY = r"""
# Job ids or node names ($1: @jobs, @all-jobs or @nodes) as the daemon lists them, one a line;
# nothing, and no message, when it does not answer in time.  $2: elasticctl; $3: --socket's value.
_elasticctl_list() {
    command "$2" ${3:+--socket "$3"} completion --words "${1#@}" 2>/dev/null </dev/null
}

# COMPREPLY for $1 (a value or an operand: @files, @dirs, @any, @jobs, @all-jobs, @nodes, or
# the choices) and the word being completed, $2; $3 $4: elasticctl and --socket's value.
_elasticctl_offer() {
    case $1 in
        '' | @any) ;;
        @files) compopt -o filenames 2>/dev/null; mapfile -t COMPREPLY < <(compgen -f -- "$2") ;;
        @dirs) compopt -o filenames 2>/dev/null; mapfile -t COMPREPLY < <(compgen -d -- "$2") ;;
        @jobs | @all-jobs | @nodes)
            mapfile -t COMPREPLY < <(compgen -W "$(_elasticctl_list "$1" "$3" "$4")" -- "$2") ;;
        *) mapfile -t COMPREPLY < <(compgen -W "$1" -- "$2") ;;
    esac
}

_elasticctl() {
    local cur=${COMP_WORDS[COMP_CWORD]} prog=${COMP_WORDS[0]}
    local command= socket= value= rest= word i next operands=0
    COMPREPLY=()
    [[ $cur == = ]] && return 0  # right after --option= (split there by COMP_WORDBREAKS)
    command -v -- "$prog" >/dev/null 2>&1 || prog=elasticctl
    # the words before the cursor: options and their values, the command, its operands
    for ((i = 1; i < COMP_CWORD; i++)); do
        word=${COMP_WORDS[i]}
        [[ -n $rest ]] && continue  # the script's own arguments
        if [[ -n ${_elasticctl_values["${command:-elasticctl} $word"]+set} ]]; then
            next=$((i + 1))
            [[ ${COMP_WORDS[next]} == = ]] && next=$((next + 1))  # --option=value
            if ((next == COMP_CWORD)); then
                value=${_elasticctl_values["${command:-elasticctl} $word"]}
            elif [[ $word == --socket ]]; then
                socket=${COMP_WORDS[next]}
            fi
            i=$next
            continue
        fi
        if [[ $word == -- && -n ${_elasticctl_remainder[${command:-elasticctl}]+set} ]]; then
            rest=1
            continue
        fi
        [[ $word == -* ]] && continue
        if [[ -z $command ]]; then
            command=$word
            continue
        fi
        operands=$((operands + 1))
        [[ -n ${_elasticctl_remainder[$command]+set} ]] && rest=1
    done
    if [[ -n $value ]]; then
        _elasticctl_offer "$value" "$cur" "$prog" "$socket"
    elif [[ -z $command && $cur == -* ]]; then
        _elasticctl_offer "${_elasticctl_options[elasticctl]}" "$cur"
    elif [[ -z $command ]]; then
        _elasticctl_offer "$_elasticctl_commands" "$cur"
    elif [[ -n $rest ]]; then
        _elasticctl_offer @files "$cur"
    elif [[ $cur == -* ]]; then
        _elasticctl_offer "${_elasticctl_options[$command]}" "$cur"
    elif ((operands == 0)); then
        _elasticctl_offer "${_elasticctl_operands[$command]}" "$cur" "$prog" "$socket"
    fi
    return 0
}

complete -F _elasticctl elasticctl
"""


# -- zsh ------------------------------------------------------------------------------------


def zsh(line: CommandLine) -> str:
    """A zsh completion function (#compdef): _arguments specs for every command."""
    described = "\n".join(
        f"        {_zq(_escape_colon(name) + ':' + _alias_help(command, name))}"
        for command in line.commands
        for name in command.names
    )
    cases = "\n".join(_zsh_case(command) for command in line.commands)
    return ZSH.format(globals=_zsh_specs(line.options, indent=4), commands=described, cases=cases)


def _alias_help(command: Command, name: str) -> str:
    return command.help if name == command.names[0] else f"{command.help} ({command.names[0]})"


def _zsh_case(command: Command) -> str:
    specs = _zsh_specs(command.options, indent=12)
    if command.operand:
        operand = f"1:{_escape_colon(command.operand_name)}:{_zsh_action(command.operand)}"
        specs += f" \\\n            {_zq(operand)}"
    if command.remainder:
        specs += f" \\\n            {_zq('*::script argument:_files')}"
    flags = "-S -A '-*' " if command.remainder else "-S "
    return (
        f"        ({'|'.join(command.names)})\n"
        f"            _arguments {flags}: \\\n            {specs.lstrip()} && ret=0 ;;"
    )


def _zsh_specs(options: tuple[Option, ...], indent: int) -> str:
    pad = " " * indent
    return " \\\n".join(pad + _zq(spec) for option in options for spec in _zsh_option(option))


def _zsh_option(option: Option) -> list[str]:
    """One _arguments spec per spelling: they exclude each other unless repeatable."""
    every = option.names + option.aliases
    if "--help" in every:
        return [f"(- : *){name}[{_escape_help(option.help)}]" for name in every]
    exclusion = "*" if option.repeatable else f"({' '.join(every)})"
    specs = []
    for name in every:
        hidden = "" if name in option.names else "!"  # understood, not offered
        spec = f"{hidden}{exclusion}{name}"
        if option.value is not None:
            spec += "=" if name.startswith("--") else "+"
        spec += f"[{_escape_help(option.help)}]"
        if option.value is not None:
            spec += f":{_escape_colon(option.metavar)}:{_zsh_action(option.value)}"
        specs.append(spec)
    return specs


def _zsh_action(value: str) -> str:
    if value == FILES:
        return "_files"
    if value == DIRS:
        return "_files -/"
    if value == ANY:
        return " "
    if value in (JOBS, ALL_JOBS, NODES):
        return f"{{_elasticctl_list {value}}}"  # {...}: called as written (no compadd options)
    return f"({value})"


def _escape_help(text: str) -> str:
    return re.sub(r"([\\\[\]:])", r"\\\1", text)


def _escape_colon(text: str) -> str:
    return text.replace("\\", "\\\\").replace(":", "\\:")


def _zq(text: str) -> str:
    """Single-quoted for zsh."""
    return "'" + text.replace("'", "'\\''") + "'"


ZSH = r"""#compdef elasticctl
# zsh completion for elasticctl, generated by `elasticctl completion zsh` from its own parser:
# install it as _elasticctl in a directory of $fpath (/usr/share/zsh/vendor-completions).

# Job ids or node names ($1: @jobs, @all-jobs or @nodes) as the daemon lists them; nothing,
# and no message, when it does not answer in time.
_elasticctl_list() {{
  local tag=jobs what=job expl socket=${{(Q)opt_args[--socket]:-$_elasticctl_socket}}
  local -a request found
  [[ $1 == @nodes ]] && tag=nodes what=node
  [[ -n $socket ]] && request=(--socket $socket)
  found=(${{(f)"$(command $_elasticctl_prog $request completion --words ${{1#@}} 2>/dev/null </dev/null)"}})
  _wanted $tag expl $what compadd -a found
}}

_elasticctl() {{
  local curcontext=$curcontext state state_descr line ret=1
  local -A opt_args
  local _elasticctl_prog=${{(Q)words[1]}} _elasticctl_socket
  (( $+commands[$_elasticctl_prog] )) || [[ -x $_elasticctl_prog ]] || _elasticctl_prog=elasticctl
  _arguments -C : \
{globals} \
    '(-): :->command' \
    '(-)*:: :->args' && ret=0
  _elasticctl_socket=${{(Q)opt_args[--socket]}}
  case $state in
    (command)
      local -a commands=(
{commands}
      )
      _describe -t commands 'elasticctl command' commands && ret=0 ;;
    (args)
      curcontext=${{curcontext%:*:*}}:elasticctl-$words[1]:
      case $words[1] in
{cases}
      esac ;;
  esac
  return ret
}}

_elasticctl "$@"
"""
