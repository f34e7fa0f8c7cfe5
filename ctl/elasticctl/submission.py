"""What ``submit`` and ``run`` send: the types of their options (each raises
ArgumentTypeError, which argparse reports as usage), the request built from the command line
as the submitter sees it from here, and the checks that its script can run."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import stat
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from elasticctl import torchrun
from elasticctl.client import ClientError
from elasticd.wire import numbers, protocol


class UsageError(Exception):
    """A command line that cannot be turned into a request (exit status 2)."""


# -- argument types (each raises ArgumentTypeError, which argparse reports as usage) ---------


def nnodes(value: str) -> str:
    """'N' or 'MIN:MAX' with 1 <= MIN <= MAX; sent to the daemon as typed."""
    try:
        protocol.parse_nnodes(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def nproc_per_node(value: str) -> int | str:
    try:
        return protocol.parse_nproc(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(value: str) -> int:
    number = non_negative_int(value)
    if number == 0:
        raise argparse.ArgumentTypeError("expected a number of at least 1, got 0")
    return number


def non_negative_int(value: str) -> int:
    try:
        number = numbers.whole(value, signed=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a number of at least 0, got {value!r}")
    return number


def integer(value: str) -> int:
    try:
        return numbers.whole(value, signed=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_SIZE = re.compile(r"([0-9]+)([KMGT]?)(?:i?B)?", re.IGNORECASE | re.ASCII)


def size(value: str) -> int:
    """A size: bytes, or 512M, 8G, 1TiB (powers of 1024)."""
    found = _SIZE.fullmatch(value.strip())
    if found is None or int(found.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"expected a size such as 8G or 512M, got {value!r}")
    return int(found.group(1)) << (10 * " KMGT".index(found.group(2).upper() or " "))


def account(value: str) -> str:
    if not value or any(c.isspace() for c in value):
        raise argparse.ArgumentTypeError(f"expected a group name, got {value!r}")
    return value


def seconds(value: str) -> int | float:
    try:
        number = numbers.decimal(value, signed=True)
    except ValueError:
        number = -1.0
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}")
    return int(number) if number.is_integer() else number


def positive_seconds(value: str) -> int | float:
    number = seconds(value)
    if number == 0:
        raise argparse.ArgumentTypeError("expected more than 0 seconds, got 0")
    return number


def names(value: str) -> list[str]:
    """'a,b' -> ['a', 'b']."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected node names separated by commas, got {value!r}")
    return items


def env_pair(value: str) -> tuple[str, str]:
    key, equals, val = value.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VAL, got {value!r}")
    return key, val


# -- the arguments after SCRIPT ---------------------------------------------------------------

SCRIPTS_OWN = frozenset({"-h", "--help"})  # after SCRIPT, help is the script's (torchrun's rule)


def own_options_after_script(
    parser: argparse.ArgumentParser, script_args: Sequence[str]
) -> tuple[list[str], list[str]]:
    """Split the arguments after SCRIPT into ``parser``'s own options (each with its value:
    ``--opt V`` or ``--opt=V``; a missing V is named by its metavar) and the rest, the
    script's.  Names match exactly: a script's
    ``--nproc`` is not elasticctl's ``--nproc-per-node``."""
    actions = {
        name: action
        for action in parser._actions
        for name in action.option_strings
        if name not in SCRIPTS_OWN
    }
    ours: list[str] = []
    theirs: list[str] = []
    index = 0
    while index < len(script_args):
        arg = script_args[index]
        name, equals, _ = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        action = actions.get(name)
        width = 1 if action is None or equals or action.nargs == 0 else 2
        taken = list(script_args[index : index + width])
        if action is not None and len(taken) < width:  # its value missing: name what goes there
            taken.append(str(action.metavar or action.dest.upper()))
        (theirs if action is None else ours).extend(taken)
        index += width
    return ours, theirs


def misplaced_options_message(
    argv: Sequence[str],
    script_args: Sequence[str],
    ours: Sequence[str],
    theirs: Sequence[str],
    prog: str = "elasticctl",
) -> str:
    """The refusal of elasticctl options written after SCRIPT, with both command lines the user
    may have meant.  ``argv`` ends with SCRIPT and ``script_args``."""
    before = list(argv[: len(argv) - len(script_args)])  # ... SCRIPT
    moved = shlex.join([prog, *before[:-1], *ours, before[-1], *theirs])
    passed = shlex.join([prog, *before, "--", *script_args])
    return (
        f"{shlex.join(ours)} after the script would be the script's own arguments, not "
        f"elasticctl's options.\nPut elasticctl's options before the script:\n  {moved}\n"
        f"or, to pass them to the script unchanged, put '--' before them:\n  {passed}"
    )


# -- requests -------------------------------------------------------------------------------

OPTIONAL_SUBMIT_ARGS = (
    "max_restarts",
    "name",
    "nodes",
    "exclude",
    "join_timeout",
    "last_call_timeout",
    "exit_barrier_timeout",
    "rejoin_timeout",
    "hang_timeout",
    "priority",
    "account",
    "nnodes_step",
    "spares",
    "keep_checkpoints",
    "checkpoint_memory",
)


def submit_request(
    args: argparse.Namespace, environ: Mapping[str, str], cwd: str, private: bool = False
) -> dict[str, Any]:
    """The ``submit`` request's args: the job as the submitter sees it from here.
    ``private``: for elasticrun's private daemons, whose launcher topology the line says."""
    if args.script is None:
        raise UsageError(f"{args.command}: SCRIPT is required")
    if args.module and args.no_python and not args.run_path:
        raise UsageError(f"{args.command}: -m and --no-python exclude each other")
    kind = torchrun.kind(args)
    one_node = protocol.parse_nnodes(args.nnodes)[1] == 1
    try:
        from_torchrun = torchrun.job_options(args, one_node, private)
    except torchrun.TorchrunError as exc:
        raise UsageError(str(exc)) from None
    request: dict[str, Any] = {
        "argv": [args.script, *args.script_args],
        "kind": kind,
        "workdir": absolute(args.workdir or cwd, cwd),
        **checkpoint_dir(args.checkpoint_dir, cwd),
        "env": {**environ, **dict(args.env)},
        "nnodes": args.nnodes,
        "nproc_per_node": args.nproc_per_node,
    }
    python = submitter_python(args.python, environ, cwd)
    if python is None and kind != "exec":
        raise UsageError(
            f"{args.command}: no python3 found (no active venv, none on PATH); use --python"
        )
    if python is not None:
        request["python"] = python
    request.update(given(args, OPTIONAL_SUBMIT_ARGS))
    request.update({key: value for key, value in from_torchrun.items() if key not in request})
    if args.in_place:
        request["in_place"] = True
    if args.preemptible:
        request["preemptible"] = True
    if args.warm_restart:
        request["warm_restart"] = True
    if args.wait:
        request["wait"] = True
    return request


def checkpoint_dir(value: str | None, cwd: str) -> dict[str, str]:
    """--checkpoint-dir, absolute; refused here when it exists and the submitter cannot
    write it (a directory that is not there is made on each node, as the job's user)."""
    if not value:
        return {}
    path = absolute(value, cwd)
    if os.path.lexists(path) and not (os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)):
        raise UsageError(f"--checkpoint-dir {path}: not a directory you can write")
    return {"checkpoint_dir": path}


def output_plan(args: argparse.Namespace, environ: Mapping[str, str]) -> torchrun.Output:
    """How the workers' output is shown by a following client (run, or submit --wait)."""
    try:
        plan = torchrun.output(args, environ)
    except torchrun.TorchrunError as exc:
        raise UsageError(str(exc)) from None
    if plan.needs_follower and args.command == "submit" and not args.wait:
        raise UsageError(
            "--log-dir, --redirects, --tee and --local-ranks-filter act on the output "
            "as it is followed: add --wait, or use `elasticctl run` or elasticrun "
            "(`elasticctl logs JOB` shows a job's output at any time)"
        )
    return plan


def check_runnable(request: Mapping[str, Any]) -> None:
    """Refuse what could only fail every worker: a missing workdir, script, python or
    executable.  Checked here, with the submitter's own rights (the daemon never looks:
    as root it would tell a user about files that user cannot see)."""
    workdir, first = request["workdir"], request["argv"][0]
    _need(workdir, "workdir", is_dir=True)
    if request["kind"] == "exec":
        path = (
            first
            if "/" in first
            else shutil.which(first, path=request["env"].get("PATH", os.defpath))
        )
        if path is None:
            raise ClientError(f"submit: executable {first} not found on PATH", "invalid_spec")
        _need(absolute(path, workdir), "executable", executable=True)
        return
    _need(request["python"], "python", executable=True)
    if request["kind"] == "script":
        where = "" if os.path.isabs(first) else f" in {workdir}"
        script = absolute(first, workdir)
        if os.path.isdir(script):  # python runs a directory's __main__.py, as torchrun does
            if not os.path.exists(os.path.join(script, "__main__.py")):
                raise ClientError(
                    f"submit: script {first}{where} is a directory without a "
                    "__main__.py; name the script in it",
                    "invalid_spec",
                )
            script = os.path.join(script, "__main__.py")
        _need(script, "script", readable=True, where=where, named=first)


def _need(
    path: str,
    what: str,
    *,
    is_dir: bool = False,
    executable: bool = False,
    readable: bool = False,
    where: str = "",
    named: str | None = None,
) -> None:
    named = named or path
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ClientError(f"submit: {what} {named} not found{where}", "invalid_spec") from None
    except OSError as exc:
        raise ClientError(f"submit: {what} {named}: {exc.strerror}", "invalid_spec") from None
    kind_ok = stat.S_ISDIR(info.st_mode) if is_dir else stat.S_ISREG(info.st_mode)
    if not kind_ok:
        raise ClientError(
            f"submit: {what} {named} is not a {'directory' if is_dir else 'file'}", "invalid_spec"
        )
    mode = (os.X_OK if is_dir or executable else 0) | (os.R_OK if readable else 0)
    if mode and not os.access(path, mode):
        raise ClientError(f"submit: {what} {named}: Permission denied", "invalid_spec")


def submitter_python(
    chosen: str | None, environ: Mapping[str, str], cwd: str, own_venv: str | None = None
) -> str | None:
    """The interpreter a user means, as an absolute path: --python, else the active venv's
    python3, else the venv elasticctl runs from when torch is installed there (a user who ran
    .venv/bin/elasticctl without activating it), else the python3 on PATH.

    Symlinks are kept as they are: a venv's python is a symlink to the base interpreter, and
    only the link's own path makes it run with the venv's packages.
    """
    path = environ.get("PATH", os.defpath)
    if chosen:
        found = chosen if os.sep in chosen else shutil.which(chosen, path=path)
        if found is None:
            raise UsageError(f"--python {chosen}: not found on PATH")
        return absolute(found, cwd)
    venv_python = os.path.join(environ.get("VIRTUAL_ENV", ""), "bin", "python3")
    if environ.get("VIRTUAL_ENV") and os.path.exists(venv_python):
        return absolute(venv_python, cwd)
    own = own_venv_python() if own_venv is None else own_venv
    if own:
        return own
    found = shutil.which("python3", path=path)
    return absolute(found, cwd) if found else None


def own_venv_python() -> str:
    """This interpreter's venv python3 when it is a venv with torch installed, else ''.
    (Finding torch's spec does not import it.)"""
    if sys.prefix == sys.base_prefix:
        return ""
    import importlib.util

    python = os.path.join(sys.prefix, "bin", "python3")
    if not os.path.exists(python) or importlib.util.find_spec("torch") is None:
        return ""
    return python


def absolute(path: str, cwd: str) -> str:
    return os.path.normpath(os.path.join(cwd, path))


def given(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The options among ``names`` that were given on the command line."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
