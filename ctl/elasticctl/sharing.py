"""The cluster-sharing commands: `queue` (who waits, in which order, and why) and `usage`
(who used what: sreport's job)."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

from elasticctl import render
from elasticctl.client import Client
from elasticctl.output import emit
from elasticctl.submission import UsageError
from elasticctl.when import when

Command = Callable[..., argparse.ArgumentParser]
Connect = Callable[[argparse.Namespace], Client]

USAGE_HELP = """\
What the cluster's jobs used, from every job the daemon knows (the history keeps ended jobs
for history.retention, 30 days by default): node-, slot- and GPU-hours and jobs, per user
and per account, from the time each node's workers first ran to its part's end."""


def add_queue(command: Command, connect: Connect) -> None:
    def cmd_queue(args: argparse.Namespace) -> int:
        with connect(args) as daemon:
            result = daemon.call("queue")
        emit(args, result, lambda: render.queue_table(result, time.time()))
        return 0

    command(
        "queue",
        cmd_queue,
        "list waiting jobs in start order, and why each waits",
        epilog=render.QUEUE_REASONS,
    )


def add_usage(command: Command, connect: Connect) -> None:
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

    usage = command(
        "usage", cmd_usage, "node-, slot- and GPU-hours per user and account", USAGE_HELP
    )
    usage.add_argument("--user", metavar="U", help="only U's jobs")
    usage.add_argument("--account", metavar="A", help="only jobs charged to account A")
    usage.add_argument(
        "--since", type=when, metavar="T", help="from T: 2024-05-01[T13:30], or 7d, 12h ago"
    )
    usage.add_argument("--until", type=when, metavar="T", help="up to T (default: now)")
