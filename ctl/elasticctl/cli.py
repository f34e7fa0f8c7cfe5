"""elasticctl: the command line of elasticd (docs/getting-started.md).

Exit status: 0 success; 1 the daemon refused the request (or, for ``submit --wait``, the job
failed); 2 usage error or daemon not reachable; 130 interrupted, or the waited-for job was
cancelled.  With --json stdout carries exactly one JSON document (streams: one per line)
and an error is {"error": {"code": ..., "message": ...}}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from elasticctl import follow, render, topology, torchrun
from elasticctl.client import DEFAULT_TIMEOUT, Client, ClientError, RemoteError, Unavailable
from elasticctl.output import ProgressLine, emit, error_doc, terminal_width
from elasticctl.submission import (
    UsageError,
    account,
    check_runnable,
    env_pair,
    given,
    integer,
    misplaced_options_message,
    names,
    nnodes,
    non_negative_int,
    nproc_per_node,
    output_plan,
    own_options_after_script,
    positive_int,
    positive_seconds,
    seconds,
    size,
    submit_request,
)
from elasticctl.when import when
from elasticd import __version__
from elasticd.wire import numbers, paths

EXIT_BY_STATE = {"SUCCEEDED": 0, "FAILED": 1, "CANCELLED": 130}
INTERRUPTED = 130


# -- parsing --------------------------------------------------------------------------------


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Parse the command line, applying submit's two rules for the script's own arguments.

    With a bare ``--``, everything after it belongs to the script and elasticctl options may
    come before or after SCRIPT.  Without one, torchrun's rule: the first positional is SCRIPT
    and everything after it is passed to the script unchanged.  ``environ``: where torchrun's
    PET_* variables are read (default: this process's environment).
    """
    argv, environ = list(argv), os.environ if environ is None else environ
    if "--" not in argv or not set(JOB_COMMANDS) & set(argv[: argv.index("--")]):
        return _refuse_own_options_after_script(
            _parse(build_parser(environ, torchrun_rule=True), argv), argv
        )
    split = argv.index("--")
    args = _parse(build_parser(environ, torchrun_rule=False), argv[:split])
    args.script_args = argv[split + 1 :]
    if args.script is None and args.script_args:
        args.script = args.script_args.pop(0)
    return args


def _refuse_own_options_after_script(
    args: argparse.Namespace, argv: list[str]
) -> argparse.Namespace:
    """torchrun's rule gives the script everything after SCRIPT; an option of submit's or run's
    own there is almost surely misplaced (``submit train.py --nproc-per-node 2 --wait`` would
    run one worker and not wait), so it is refused with the command lines the user may have
    meant.  elasticrun keeps torchrun's rule as it is: it does not come through here."""
    if args.command not in JOB_COMMANDS or not args.script_args:
        return args
    ours, theirs = own_options_after_script(args.command_parser, args.script_args)
    if ours:
        args.command_parser.error(misplaced_options_message(argv, args.script_args, ours, theirs))
    return args


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, but an unknown option is reported with its command's usage."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "command_parser", parser).error(
            f"unrecognized arguments: {' '.join(unknown)}"
        )
    return args


JOB_COMMANDS = ("submit", "run")


def build_parser(environ: Mapping[str, str], torchrun_rule: bool = True) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    add_common_options(common, default=argparse.SUPPRESS)
    parser = argparse.ArgumentParser(
        prog="elasticctl",
        description="Control elasticd, the elastic PyTorch job daemon.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_options(parser, default=None)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(
        name: str,
        handler: Callable[[argparse.Namespace], int],
        help: str,
        description: str | None = None,
        **kwargs: Any,
    ) -> argparse.ArgumentParser:
        """A command; ``help`` is its one line in elasticctl --help."""
        sub = commands.add_parser(
            name,
            help=help,
            description=description or help,
            parents=[common],
            formatter_class=argparse.RawDescriptionHelpFormatter,
            **kwargs,
        )
        sub.set_defaults(handler=handler, command_parser=sub)
        return sub

    add_submit_options(
        command(
            "submit",
            cmd_submit,
            "submit a job to the cluster",
            usage=JOB_USAGE,
            epilog=SUBMIT_RULES,
            allow_abbrev=False,
        ),
        environ,
        torchrun_rule,
    )
    add_submit_options(
        command(
            "run",
            cmd_run,
            "submit a job and show its output until it ends",
            RUN_HELP,
            usage=JOB_USAGE,
            epilog=SUBMIT_RULES,
            allow_abbrev=False,
        ),
        environ,
        torchrun_rule,
        following=True,
    )
    listing = command("list", cmd_list, "list jobs", aliases=["ps"])
    listing.add_argument("--all", "-a", action="store_true", help="include finished jobs")
    command(
        "queue",
        cmd_queue,
        "list waiting jobs in start order, and why each waits",
        epilog=render.QUEUE_REASONS,
    )
    status = command("status", cmd_status, "show one job in detail")
    status.add_argument("job", metavar="JOB")
    status.add_argument(
        "--debug",
        action="store_true",
        help="also the job's story on this node: the last events its part heard "
        "and what it did about each (owner and admins only), and for admins the node's own "
        "story (holds, placement, the schedule, GPU health)",
    )
    add_logs_options(command("logs", cmd_logs, "show a job's worker output", epilog=LOGS_FORMAT))
    command("cancel", cmd_cancel, "cancel a job").add_argument("job", metavar="JOB")
    command("nodes", cmd_nodes, "list the cluster's nodes").add_argument(
        "--watch", "-w", action="store_true", help="print the list again whenever it changes"
    )
    command("drain", cmd_drain, "stop placing jobs on a node; its jobs move off it").add_argument(
        "node", metavar="NODE"
    )
    undrain = command("undrain", cmd_undrain, "let a drained or blacklisted node take jobs again")
    undrain.add_argument("node", metavar="NODE")
    undrain.add_argument(
        "--gpu",
        type=gpu_index,
        metavar="N",
        help="only put GPU N back in the node's offer (taken out as bad by its health checks)",
    )
    usage = command(
        "usage", cmd_usage, "node-, slot- and GPU-hours per user and account", USAGE_HELP
    )
    usage.add_argument("--user", metavar="U", help="only U's jobs")
    usage.add_argument("--account", metavar="A", help="only jobs charged to account A")
    usage.add_argument(
        "--since", type=when, metavar="T", help="from T: 2024-05-01[T13:30], or 7d, 12h ago"
    )
    usage.add_argument("--until", type=when, metavar="T", help="up to T (default: now)")
    command("version", cmd_version, "show the client's and the daemon's versions")
    completion = command(
        "completion",
        cmd_completion,
        "print the shell completion script for bash or zsh",
        COMPLETION_HELP,
    )
    completion.add_argument("shell", metavar="SHELL", nargs="?", choices=("bash", "zsh"))
    completion.add_argument(
        "--words", choices=COMPLETED_WORDS, help=argparse.SUPPRESS
    )  # the scripts'
    return parser


COMPLETED_WORDS = ("jobs", "all-jobs", "nodes")  # what `completion --words` lists for the scripts
COMPLETION_HELP = """\
Print elasticctl's completion script for SHELL: commands, options, job ids and node names.
  bash: source <(elasticctl completion bash)       (or install it as
        /usr/share/bash-completion/completions/elasticctl)
  zsh:  elasticctl completion zsh > ~/.zfunc/_elasticctl, with ~/.zfunc in $fpath before
        compinit (or install it as /usr/share/zsh/vendor-completions/_elasticctl)"""
JOB_USAGE = "%(prog)s [options] SCRIPT [ARGS ...]   (--help lists every option)"
RUN_HELP = (
    "submit a job and show its output until it ends, as torchrun does; exit with its "
    "result (Ctrl-C cancels it)"
)


def add_common_options(parser: argparse.ArgumentParser, default: Any) -> None:
    """--socket and --json: accepted before the command and (as a convenience) after it."""
    parser.add_argument(
        "--socket",
        metavar="PATH",
        default=default,
        help="the daemon's control socket (default: $ELASTICD_SOCKET, else "
        "your own daemon's socket if it exists, else /run/elasticd/control.sock)",
    )
    parser.add_argument(
        "--json", action="store_true", default=default, help="print JSON documents instead of text"
    )


def add_submit_options(
    sub: argparse.ArgumentParser,
    environ: Mapping[str, str],
    torchrun_rule: bool,
    following: bool = False,
) -> None:
    """The job's options; ``following``: the command follows the job anyway (run)."""

    def option(*names: str, **kwargs: Any) -> None:
        """Each --long-name also answers (silently) to torchrun's --long_name."""
        sub.add_argument(*names, **kwargs)
        for name in names:
            if name.startswith("--") and "-" in name[2:]:
                sub.add_argument(
                    "--" + name[2:].replace("-", "_"), **{**kwargs, "help": argparse.SUPPRESS}
                )

    option("--name", help="a name for the job (default: the script's)")
    option(
        "--env",
        type=env_pair,
        action="append",
        default=[],
        metavar="KEY=VAL",
        help="set a variable in the workers' environment (repeatable)",
    )
    option("--workdir", metavar="DIR", help="the workers' working directory (default: here)")
    option(
        "--python",
        metavar="PATH",
        help="the interpreter (default: the active venv's python3, else the venv elasticctl "
        "runs from if it has torch, else python3 on your PATH)",
    )
    option("--nodes", type=names, action="extend", metavar="A,B", help="run only on these nodes")
    option("--exclude", type=names, action="extend", metavar="C,D", help="never run on these nodes")
    option(
        "--join-timeout",
        type=positive_seconds,
        metavar="S",
        help="fail if too few nodes join within S seconds (default: the daemon's)",
    )
    option(
        "--last-call-timeout",
        type=seconds,
        metavar="S",
        help="after MIN nodes joined, wait S seconds for more before starting "
        "(default: the daemon's)",
    )
    option(
        "--exit-barrier-timeout",
        type=positive_seconds,
        metavar="S",
        help="after local success, wait up to S seconds for the other nodes "
        "(default: the daemon's)",
    )
    option(
        "--in-place",
        action="store_true",
        help="survivors keep their processes when the job re-forms (the script uses "
        "elasticd.elastic: State, commit, @run); only missing workers are started",
    )
    option(
        "--warm-restart",
        action="store_true",
        help="keep a Python interpreter per worker waiting on every node, torch already "
        "imported, to run the script when the job restarts its workers (a failure, a lost "
        "or a new node): the restart skips Python's and torch's start (seconds), at the "
        "cost of one idle interpreter per worker (hundreds of MB each)",
    )
    option(
        "--rejoin-timeout",
        type=positive_seconds,
        metavar="S",
        help="in place: a survivor that has not asked for its new place S seconds after a "
        "change is stopped and the job restarts every worker (default 60)",
    )
    option(
        "--hang-timeout",
        type=positive_seconds,
        metavar="S",
        help="ranks that report no progress for S seconds (the worker library's commit or "
        "elastic.progress()) are hung: their stacks go to the job's logs, the rank not inside "
        "a collective is failed as the root cause and replaced (in place) or the job "
        "restarts (default: never)",
    )
    option(
        "--spares",
        type=integer,
        metavar="K",
        help="in place: keep up to K warm workers per node beside the placed ones (in free "
        "slots), started and parked in elastic.run; a lost worker's place is taken by "
        "one at once, and a new one warms up (default 0)",
    )
    option(
        "--priority",
        type=integer,
        metavar="N",
        help="start before jobs of lower priority (default 0); above 0 as far as the "
        "cluster's config lets you (scheduler.max_priority), below 0 always",
    )
    option(
        "--account",
        type=account,
        metavar="GROUP",
        help="the group whose fair share and quota the job uses: one you are in "
        "(default: your primary group)",
    )
    option(
        "--preemptible",
        action="store_true",
        help="the job may be stopped below its MIN nodes for a job ahead of it, and is "
        "requeued (no restart spent) to resume from its checkpoint",
    )
    option(
        "--checkpoint-dir",
        metavar="DIR",
        help="also write every complete checkpoint of ELASTICD_CHECKPOINT_DIR to DIR, in the "
        "background, as you (any path you can write, local or shared); default: memory only",
    )
    option(
        "--keep-checkpoints",
        type=positive_int,
        metavar="K",
        help="with --checkpoint-dir: keep the last K checkpoints there (default 3)",
    )
    option(
        "--checkpoint-memory",
        type=size,
        metavar="SIZE",
        help="what the job's checkpoints may hold in memory on each node, e.g. 8G (default: "
        "the node's checkpoints.job_memory); a save over it fails and the one before stays",
    )
    option(
        "--nnodes-step",
        type=positive_int,
        metavar="K",
        help="run on a multiple of K nodes only, so that world sizes keep the batch maths "
        "valid (default 1)",
    )
    if following:
        sub.set_defaults(wait=False)
    else:
        option(
            "--wait",
            action="store_true",
            help="follow the job until it ends; exit 0 succeeded, 1 failed, 130 cancelled",
        )
    torchrun_options = sub.add_argument_group(
        "torchrun's options",
        "every torchrun option, in both spellings, also read from PET_* "
        "as torchrun reads it; each one's treatment under elasticd:",
    )
    torchrun.add_options(
        torchrun_options,
        environ,
        {"nnodes": nnodes, "nproc_per_node": nproc_per_node, "max_restarts": non_negative_int},
    )
    sub.add_argument(
        "script",
        metavar="SCRIPT",
        nargs="?",
        help="the training script (module with -m, executable with --no-python)",
    )
    if torchrun_rule:
        sub.add_argument(
            "script_args",
            metavar="ARGS",
            nargs=argparse.REMAINDER,
            help="passed to the script; put them after '--' to give elasticctl "
            "options after SCRIPT",
        )
    else:
        sub.set_defaults(script_args=[])


SUBMIT_RULES = """\
The script's arguments: without a bare '--', the first positional is SCRIPT and everything
after it goes to the script (torchrun's rule), except that one of this command's own options
there is refused as misplaced (-h/--help there is the script's).  With '--', everything after
it goes to the script unchanged and elasticctl's options may come before or after SCRIPT:
  elasticctl submit train.py --nnodes 2:4 --nproc-per-node gpu -- --epochs 10
  elasticctl submit train.py -- --wait          (the script gets --wait)
torchrun's spellings (--nproc_per_node, --max_restarts, --no_python, ...) work too."""


def add_logs_options(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("job", metavar="JOB")
    sub.add_argument("--rank", "-r", type=non_negative_int, metavar="R", help="only this rank")
    sub.add_argument(
        "--attempt",
        type=non_negative_int,
        metavar="N",
        help="only this attempt: the job's rendezvous round (0 = the first run; each "
        "restart, scale-up or lost node starts the next; default: all)",
    )
    sub.add_argument(
        "--follow", "-f", action="store_true", help="keep printing new output until the job ends"
    )


LOGS_FORMAT = """\
output format:
  [rank 3] text              a line that rank 3 wrote to stdout
  [rank 3 err] text          a line that rank 3 wrote to stderr
  [rank 3 attempt 1] text    the same in the job's next round (a restart or a membership change)
with --json: one JSON object per line, {"rank", "stream", "attempt", "node", "text"}"""


# -- commands -------------------------------------------------------------------------------


def connect(args: argparse.Namespace) -> Client:
    return Client(args.socket or paths.default_socket_path(), reply_timeout(os.environ))


def reply_timeout(environ: Mapping[str, str]) -> float:
    value = environ.get("ELASTICCTL_TIMEOUT")
    if not value:
        return DEFAULT_TIMEOUT
    try:
        timeout = numbers.decimal(value)
    except ValueError:
        timeout = -1.0
    if not 0 < timeout < float("inf"):
        raise UsageError(f"ELASTICCTL_TIMEOUT={value!r}: expected a positive number of seconds")
    return timeout


def cmd_submit(args: argparse.Namespace) -> int:
    request = submit_request(args, os.environ, os.getcwd())
    plan = output_plan(args, os.environ)
    check_runnable(request)
    if args.wait and plan.needs_follower:
        return run_job(args, request, plan)
    with connect(args) as daemon:
        if args.wait:
            return follow_job(args, daemon.stream("submit", request))
        job = daemon.call("submit", request)
    emit(args, job, lambda: render.submitted_line(job))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    request = submit_request(args, os.environ, os.getcwd())
    plan = output_plan(args, os.environ)
    check_runnable(request)
    return run_job(args, request, plan)


def follow_job(args: argparse.Namespace, docs: Iterable[dict[str, Any]]) -> int:
    """Show each job document as it comes; the exit status follows the job's final state."""
    progress = ProgressLine(sys.stdout, None if args.json else terminal_width(sys.stdout))
    job: dict[str, Any] | None = None
    try:
        for count, job in enumerate(docs):
            if args.json:
                print(json.dumps(job), flush=True)
                continue
            if count == 0:
                print(render.submitted_line(job), flush=True)
            progress.show(render.progress_line(job, time.time()))
    except KeyboardInterrupt:
        progress.close()
        if job is not None:
            print(
                render.clean(
                    f"stopped following; job {job.get('id')} goes on "
                    f"(elasticctl cancel {job.get('id')} stops it)"
                ),
                file=sys.stderr,
            )
        return INTERRUPTED
    progress.close()
    return job_exit_status(args, job)


def run_job(args: argparse.Namespace, request: dict[str, Any], plan: torchrun.Output) -> int:
    """Submit, show the workers' output as torchrun does until the job ends, and exit with
    its result.  Ctrl-C (and the other signals torchrun handles) cancels the job: torchrun
    stops its workers when it is stopped.  They are handled from the submit on, so that one
    that comes before the output is followed cancels the job too."""
    job_id = None
    try:
        with cancelling_signals(args.signals_to_handle):
            with connect(args) as daemon:
                job = daemon.call("submit", {k: v for k, v in request.items() if k != "wait"})
            job_id = str(job.get("id"))
            if args.json:
                print(json.dumps(job), flush=True)
            line = f"{prog(args)}: {render.submitted_line(job)}"
            print(render.clean(line), file=sys.stderr, flush=True)
            return follow_run(args, job_id, plan)
    except KeyboardInterrupt:
        return INTERRUPTED if job_id is None else cancel_followed(args, job_id)


def follow_run(
    args: argparse.Namespace, job_id: str, plan: torchrun.Output, local: bool = False
) -> int:
    """Show a submitted job's output as torchrun does until it ends; its exit status.
    ``local``: the daemon's own node's workers only."""
    places = follow.RankPlaces(lambda: status_of(args, job_id))
    console = follow.Console(job_id, plan, places, sys.stdout, sys.stderr)
    try:
        with cancelling_signals(args.signals_to_handle):
            follow.stream_output(lambda: connect(args), job_id, console, local)
            job = status_of(args, job_id)
    except KeyboardInterrupt:
        return cancel_followed(args, job_id)
    finally:
        console.close()
    if args.json:
        print(json.dumps(job), flush=True)
    return job_exit_status(args, job)


def prog(args: argparse.Namespace) -> str:
    """The command's name in its messages: elasticctl, or elasticrun (``args.prog``)."""
    return getattr(args, "prog", "elasticctl")


class cancelling_signals:
    """While following: the signals torchrun handles (``--signals-to-handle``; SIGTERM,
    SIGINT, SIGHUP, SIGQUIT) interrupt like Ctrl-C, which cancels the job.  SIGINT too, as
    torchrun does: a launcher started by a script in the background inherits SIGINT ignored,
    and Python then installs no handler of its own (Ctrl-C, or ``kill -INT``, was lost)."""

    def __init__(self, names: str) -> None:
        self._signals = [getattr(signal, name) for name in torchrun.handled_signals(names)]
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> None:
        for number in self._signals:
            self._previous[number] = signal.signal(number, _interrupt)

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


class ignoring_signals(cancelling_signals):
    """While the job is being cancelled: a second Ctrl-C (or handled signal) does not cut the
    cancel short, which left the job running here (a daemon) or its line unsaid (elasticrun).
    The cancel is bounded by the reply timeout (``ELASTICCTL_TIMEOUT``)."""

    def __enter__(self) -> None:
        for number in self._signals:
            self._previous[number] = signal.signal(number, signal.SIG_IGN)


def cancel_followed(args: argparse.Namespace, job_id: str) -> int:
    with ignoring_signals(args.signals_to_handle):
        return _cancel(args, job_id)


def _cancel(args: argparse.Namespace, job_id: str) -> int:
    try:
        with connect(args) as daemon:
            job = daemon.call("cancel", {"job": job_id})
        print(render.clean(f"{prog(args)}: {render.cancelled_line(job, job_id)}"), file=sys.stderr)
    except RemoteError as exc:  # cancelled meanwhile (by another node's elasticrun) or ended
        if exc.code != "conflict":
            raise
        print(render.clean(f"{prog(args)}: job {job_id}: {exc.message}"), file=sys.stderr)
    except ClientError as exc:
        print(
            render.clean(f"{prog(args)}: could not cancel job {job_id}: {exc.message}"),
            file=sys.stderr,
        )
    return INTERRUPTED


def status_of(args: argparse.Namespace, job_id: str) -> dict[str, Any]:
    with connect(args) as daemon:
        return daemon.call("status", {"job": job_id})


def job_exit_status(args: argparse.Namespace, job: Mapping[str, Any] | None) -> int:
    """0 succeeded, 1 failed (after printing why: the root cause and the tail of the failing
    rank's stderr), 130 cancelled."""
    state = (job or {}).get("state")
    if job is None or state not in EXIT_BY_STATE:
        raise ClientError(f"elasticd ended the stream while the job was {state or 'unknown'}")
    summary = render.error_summary(job.get("error"))
    if state == "FAILED" and summary and not args.json:
        if args.command == "submit":
            print(summary, flush=True)
        print(render.failure_report(job, failing_stderr(args, job)), file=sys.stderr, flush=True)
    return EXIT_BY_STATE[state]


def failing_stderr(args: argparse.Namespace, job: Mapping[str, Any]) -> list[str]:
    """The tail of the failing rank's stderr; [] when it cannot be had (the report goes on)."""
    try:
        return follow.stderr_tail(lambda: connect(args), job)
    except ClientError:
        return []


def list_jobs(daemon: Client, all_jobs: bool) -> list[Any]:
    """Every row of the daemon's `list` stream (it sends the jobs in batches, never one
    frame of every job); --json prints them as one list, as before the stream."""
    jobs: list[Any] = []
    for result in daemon.stream("list", {"all": all_jobs}):
        if not isinstance(result, Mapping):  # a daemon from before the stream: every job, no end
            return list(result or [])
        jobs.extend(items(result, "jobs"))
    return jobs


def cmd_list(args: argparse.Namespace) -> int:
    with connect(args) as daemon:
        jobs = list_jobs(daemon, args.all)
    emit(args, jobs, lambda: render.jobs_table(jobs, time.time()))
    return 0


def cmd_queue(args: argparse.Namespace) -> int:
    with connect(args) as daemon:
        result = daemon.call("queue")
    emit(args, result, lambda: render.queue_table(result, time.time()))
    return 0


USAGE_HELP = """\
What the cluster's jobs used, from every job the daemon knows (the history keeps ended jobs
for history.retention, 30 days by default): node-, slot- and GPU-hours and jobs, per user
and per account, from the time each node's workers first ran to its part's end."""


def cmd_usage(args: argparse.Namespace) -> int:
    request: dict[str, Any] = {
        name: value
        for name in ("user", "account", "since", "until")
        if (value := getattr(args, name)) is not None
    }
    if request.get("since", -math.inf) >= min(request.get("until", math.inf), time.time()):
        raise UsageError("--since must be before --until and now")
    with connect(args) as daemon:
        result = daemon.call("usage", request)
    emit(args, result, lambda: render.usage_tables(result))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    request = {"job": args.job, **({"debug": True} if args.debug else {})}
    with connect(args) as daemon:
        job = daemon.call("status", request)
    emit(args, job, lambda: render.status_block(job, time.time()))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    request = {"job": args.job, "follow": args.follow, **given(args, ("rank", "attempt"))}
    with connect(args) as daemon:
        for result in daemon.stream("logs", request):
            for line in items(result, "lines"):
                print(json.dumps(line) if args.json else render.log_line(line))
            sys.stdout.flush()
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with connect(args) as daemon:
        job = daemon.call("cancel", {"job": args.job})
    emit(args, job, lambda: render.cancelled_line(job, args.job))
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    with connect(args) as daemon:
        if not args.watch:
            result = daemon.call("nodes")
            emit(args, result, lambda: render.nodes_table(items(result, "nodes"), time.time()))
            return 0
        for result in daemon.stream("nodes", {"watch": True}):
            print(
                json.dumps(result)
                if args.json
                else render.nodes_table(items(result, "nodes"), time.time()) + "\n",
                flush=True,
            )
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    return change_node(args, "drain")


def cmd_undrain(args: argparse.Namespace) -> int:
    return change_node(args, "undrain")


def gpu_index(value: str) -> int:
    if not numbers.is_whole(value):
        raise argparse.ArgumentTypeError(f"not a GPU index: {value!r} (0, 1, ...)")
    return numbers.whole(value)


def change_node(args: argparse.Namespace, op: str) -> int:
    gpu = getattr(args, "gpu", None)
    with connect(args) as daemon:
        node = daemon.call(op, {"node": args.node, **({"gpu": gpu} if gpu is not None else {})})
    if gpu is not None:
        emit(args, node, lambda: render.clean(f"node {args.node}: gpu {gpu} readmission requested"))
        return 0
    emit(args, node, lambda: render.node_changed_line(node, args.node, op))
    return 0


def cmd_version(args: argparse.Namespace) -> int:
    """The client's version first (it needs no daemon), then the daemon's."""
    if not args.json:
        print(f"elasticctl {__version__}", flush=True)
    try:
        with connect(args) as daemon:
            theirs = daemon.call("version")
    except Unavailable as exc:
        if args.json:
            print(
                json.dumps(
                    {
                        "elasticctl": __version__,
                        "elasticd": None,
                        **error_doc(exc.code, exc.message),
                    }
                )
            )
        print(render.clean(exc.message), file=sys.stderr)
        return 2
    emit(
        args,
        {"elasticctl": __version__, "elasticd": theirs},
        lambda: render.daemon_version_line(theirs),
    )
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    if args.words:
        return completion_words(args)
    if args.shell is None:
        raise UsageError("completion: SHELL is required (bash or zsh)")
    from elasticctl import completion  # only here: every other command starts without it

    print(completion.script(args.shell, completion.describe(build_parser({}))), end="")
    return 0


COMPLETION_TIMEOUT = 2.0  # seconds a completion may wait for the daemon


def completion_words(args: argparse.Namespace) -> int:
    """``completion --words jobs|all-jobs|nodes``, for the completion scripts: the ids of the
    jobs that have not ended (or of every job), or the nodes' names, one a line; nothing at
    all, and exit 0, when the daemon does not answer in time."""
    try:
        with Client(args.socket or paths.default_socket_path(), COMPLETION_TIMEOUT) as daemon:
            if args.words == "nodes":
                found = [node.get("name") for node in items(daemon.call("nodes"), "nodes")]
            else:
                jobs = list_jobs(daemon, args.words == "all-jobs")
                found = [
                    job.get("id")
                    for job in jobs
                    if args.words == "all-jobs" or job.get("state") not in render.TERMINAL
                ]
    except (ClientError, OSError):
        return 0
    words = [word for word in found if isinstance(word, str) and re.fullmatch(r"[\w.:@+-]+", word)]
    print("\n".join(words), end="\n" if words else "")
    return 0


def items(result: Any, key: str) -> list[Any]:
    """A result's list: the result itself, or its ``key`` member when it is an object."""
    if isinstance(result, Mapping):
        result = result.get(key)
    return list(result or [])


# -- entry point ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help, or a usage error argparse already reported
        return exc.code if isinstance(exc.code, int) else 2
    except torchrun.TorchrunError as exc:  # a PET_* variable torchrun could not read either
        return fail(argparse.Namespace(json=False), "usage", str(exc), 2)
    return dispatch(args)


def elasticrun(argv: Sequence[str] | None = None) -> int:
    """``elasticrun``: a torchrun command line, verbatim, run as a job of the local daemon
    (``elasticctl run`` with torchrun's defaults: no restarts unless asked for), or, where
    no daemon runs, on private daemons that this line starts on each node."""
    try:
        args = parse_elasticrun(list(sys.argv[1:] if argv is None else argv), os.environ)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    except torchrun.TorchrunError as exc:
        return fail(argparse.Namespace(json=False), "usage", str(exc), 2, prefix="elasticrun: ")
    return dispatch(args)


def parse_elasticrun(argv: list[str], environ: Mapping[str, str]) -> argparse.Namespace:
    """elasticrun's command line (torchrun's, and elasticctl run's options), PET_* read."""
    parser = argparse.ArgumentParser(
        prog="elasticrun",
        description=ELASTICRUN_HELP,
        usage=JOB_USAGE,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_options(parser, default=None)
    add_submit_options(parser, environ, torchrun_rule=True, following=True)
    parser.add_argument(
        "--private",
        action="store_true",
        help="run the job on daemons of its own, one that this line starts on each node, "
        "even where an elasticd runs (where none runs, it does anyway)",
    )
    parser.set_defaults(handler=cmd_elasticrun, command="run", command_parser=parser)
    parser.set_defaults(**pet_defaults(parser, environ))
    args = _parse(parser, argv)
    if args.max_restarts is None:
        args.max_restarts = 0
    args.prog = "elasticrun"
    return args


ELASTICRUN_HELP = """\
Run a torchrun command line as a job of the local elasticd: submit it, show the workers'
output as torchrun does, and exit with the job's result (0 succeeded, 1 failed, 130 after
Ctrl-C, which cancels the job).  `alias torchrun=elasticrun` works for existing scripts.
Where no elasticd runs, the line runs as torchrun's does, once per node (srun, a pod, ssh):
each elasticrun starts a private daemon for the job and they form the job's cluster.
Every torchrun option is accepted; what each one does here is listed below.  elasticrun's
own options are read from PET_<OPTION> too (PET_IN_PLACE=1, PET_SPARES=1, PET_PRIVATE=1)."""

# elasticrun's own options that PET_<DEST> sets, as torchrun's: a script that runs torchrun or
# elasticrun can keep one command line
PET_OWN = (
    "in_place",
    "spares",
    "warm_restart",
    "rejoin_timeout",
    "join_timeout",
    "last_call_timeout",
    "exit_barrier_timeout",
    "private",
)


def pet_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> dict[str, Any]:
    """The defaults PET_<DEST> gives elasticrun's own options (TorchrunError for a value the
    option would refuse); the command line wins."""
    found: dict[str, Any] = {}
    for action in parser._actions:
        value = environ.get(f"PET_{action.dest.upper()}")
        if action.dest not in PET_OWN or value is None or action.dest in found:
            continue
        if action.nargs == 0:  # a switch
            if value not in ("0", "1"):
                raise torchrun.TorchrunError(
                    f"PET_{action.dest.upper()}={value!r}: expected 0 or 1"
                )
            found[action.dest] = value == "1"
            continue
        try:
            found[action.dest] = action.type(value) if callable(action.type) else value
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise torchrun.TorchrunError(f"PET_{action.dest.upper()}={value!r}: {exc}") from None
    return found


def cmd_elasticrun(args: argparse.Namespace) -> int:
    """A daemon that answers takes the job (as ``elasticctl run``); where none does, or with
    --private, the job runs on private daemons, one per node (private.py)."""
    try:
        where = topology.resolve(args, os.environ)
    except torchrun.TorchrunError as exc:
        raise UsageError(str(exc)) from None
    if not args.private and daemon_answers(args):
        return cmd_run(args)
    from elasticctl import private  # only here: a daemon's job needs none of it

    args.nnodes = where.nnodes
    request = submit_request(args, os.environ, os.getcwd(), private=True)
    if where.backend == topology.STATIC:
        request.pop("master_port", None)  # the store's port, not the workers'
    plan = output_plan(args, os.environ)
    check_runnable(request)
    for told in where.from_slurm:
        print(f"elasticrun: {told} (from Slurm)", file=sys.stderr)
    daemon = private.start(request, where, os.environ)
    try:
        # one span from the wait to the end of the follow: no signal falls between the two
        with cancelling_signals(args.signals_to_handle):
            job = daemon.wait_job()
            args.socket = daemon.socket
            print(
                render.clean(f"elasticrun: {private_line(job, where, daemon.socket)}"),
                file=sys.stderr,
                flush=True,
            )
            return follow_run(args, str(job["job"]), plan, local=True)
    except KeyboardInterrupt:
        return INTERRUPTED
    except Unavailable:  # the daemon ended under the job: it said why on its channel
        daemon.proc.wait()
        raise private.Failed(
            daemon.last_words() or "the job's private elasticd ended; its log is above"
        ) from None
    finally:
        daemon.close()


def private_line(job: Mapping[str, Any], where: topology.Topology, socket_path: str) -> str:
    """'job j-1f2e3d on nodes of its own (store h1:29400, hosted here); this node is ...'."""
    if where.one_node:
        at = "on a daemon of its own"
    elif where.backend == topology.ETCD:
        at = f"on nodes of its own (etcd {job.get('store')})"
    else:
        hosted = ", hosted here" if job.get("hosts_store") else ""
        at = f"on nodes of its own (store {job.get('store')}{hosted})"
    return (
        f"job {job.get('job')} {at}; this node is {job.get('node')} "
        f"(elasticctl --socket {socket_path} status {job.get('job')})"
    )


def daemon_answers(args: argparse.Namespace) -> bool:
    """Whether the line goes to a daemon: one named (--socket, $ELASTICD_SOCKET) always, else
    the one elasticctl would talk to, if it answers."""
    if args.socket or os.environ.get("ELASTICD_SOCKET"):
        return True
    from elasticctl.private import daemon_reachable

    return daemon_reachable(paths.default_socket_path())


def dispatch(args: argparse.Namespace) -> int:
    try:
        return args.handler(args)
    except UsageError as exc:  # our own words: one line per refusal
        for line in str(exc).split("\n")[:-1]:
            print(render.clean(f"{prog(args)}: {line}"), file=sys.stderr)
        return fail(args, "usage", str(exc).split("\n")[-1], 2, prefix=f"{prog(args)}: ")
    except Unavailable as exc:
        return fail(args, exc.code, exc.message, 2, prefix="")
    except ClientError as exc:
        return fail(args, exc.code, exc.message, 1, prefix=f"{prog(args)}: ")
    except KeyboardInterrupt:
        return INTERRUPTED
    except BrokenPipeError:  # e.g. `elasticctl logs j-1 | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def fail(
    args: argparse.Namespace, code: str, message: str, status: int, prefix: str = "elasticctl: "
) -> int:
    print(prefix + render.clean(message), file=sys.stderr)
    if args.json:
        print(json.dumps(error_doc(code, message)))
    return status
