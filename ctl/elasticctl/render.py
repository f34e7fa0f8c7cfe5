"""Pure rendering: control-protocol documents -> the text that elasticctl prints.

Every function takes plain documents (dicts as the daemon sends them) and, where a
relative time is shown, ``now`` in unix seconds; none of them reads a clock or writes.
Missing or null fields render as ``-``; unknown extra keys are ignored.

Every string that a renderer returns is safe to print on a terminal: the documents carry
text that other users and their jobs control (names, argv, errors, tracebacks, log lines),
so each value goes through ``clean`` (table cells and fields through ``text``, one-line
renderers on the whole line) and control characters show as visible escapes.
"""

from __future__ import annotations

import math
import re
import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeGuard

Doc = Mapping[str, Any]

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
WORKER_UP = frozenset({"HEALTHY", "RUNNING"})
NONE = "-"

# What clean() escapes besides tabs: C0 controls, DEL, C1 controls, bidi controls, and lone
# surrogates (from invalid UTF-8 or JSON \ud800 escapes; print() raises on them).
_UNSAFE = r"\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE_CHARS = re.compile(f"[\t{_UNSAFE}]")
_UNSAFE_BUT_TABS = re.compile(f"[{_UNSAFE}]")
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


# -- building blocks ------------------------------------------------------------------------


def clean(value: str, *, keep_tabs: bool = False) -> str:
    """``value`` safe to print on a terminal and still readable: control characters, bidi
    controls and lone surrogates become visible escapes (``\\n``, ``\\x1b``, ``\\u202e``);
    a backslash stays as it is (this is for display, not a codec)."""
    if value.isprintable():  # none of the escaped characters is printable
        return value
    return (_UNSAFE_BUT_TABS if keep_tabs else _UNSAFE_CHARS).sub(_escape, value)


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Columns aligned on the widest cell, two spaces apart, no trailing blanks."""
    cells = [list(headers)] + [[text(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells
    )


def text(value: Any) -> str:
    """A cell or field for display: ``-`` when missing, else the value cleaned."""
    return NONE if value is None or value == "" else clean(str(value))


def duration(seconds: float) -> str:
    """A short human duration: 42s, 3m12s, 2h5m, 3d4h."""
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours}h" if hours else f"{days}d"
    if hours:
        return f"{hours}h{minutes}m" if minutes else f"{hours}h"
    if minutes:
        return f"{minutes}m{secs}s" if secs else f"{minutes}m"
    return f"{secs}s"


def ago(then: float | None, now: float) -> str:
    return NONE if then is None else f"{duration(now - then)} ago"


def local_time(then: float | None) -> str:
    return NONE if then is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(then))


def ranks(numbers: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or NONE


def fraction(part: Any, whole: Any) -> str:
    return f"{text(part)}/{text(whole)}"


# -- jobs -----------------------------------------------------------------------------------


def node_count(nnodes: Any) -> str:
    """'2:4' -> '2..4 nodes', '1:1' -> '1 node', '3' -> '3 nodes'."""
    low, _, high = str(nnodes).partition(":")
    if high and high != low:
        return f"{low}..{high} nodes"
    return "1 node" if low == "1" else f"{low} nodes"


def submitted_line(job: Doc) -> str:
    """'job j-7f3a21 submitted (waiting for 2..4 nodes)'."""
    waiting = f" (waiting for {node_count(job['nnodes'])})" if job.get("nnodes") else ""
    return clean(f"job {job.get('id')} submitted{waiting}")


def workers_up(job: Doc) -> str:
    """'2/4': workers running out of the job's world size ('-' before the first round).
    A `list` row has the counts; a job document, every worker."""
    workers = job.get("workers") or []
    total = job.get("world_size") or job.get("workers_total") or len(workers)
    if not total:
        return NONE
    up = (
        job["workers_up"]
        if "workers_up" in job
        else sum(w.get("state") in WORKER_UP for w in workers)
    )
    return fraction(up, total)


def node_total(job: Doc) -> int:
    """How many nodes the job's current round has (a `list` row has the count)."""
    return job["node_count"] if "node_count" in job else len(job.get("nodes") or [])


def barrier_progress(barrier: Doc | None, now: float) -> str | None:
    """'3/4 nodes done, 212 s left', or None when no exit barrier is pending."""
    if not barrier:
        return None
    progress = f"{text(barrier.get('done'))}/{text(barrier.get('total'))} nodes done"
    deadline = barrier.get("deadline")
    if deadline is None:
        return progress
    return f"{progress}, {max(0, round(deadline - now))} s left"


def progress_line(job: Doc, now: float) -> str:
    """One line of live progress: 'j-7f3a21  RUNNING  workers 2/2  restarts 0/1  round 0'."""
    state = job.get("state")
    fields = [text(job.get("id")), text(state)]
    if state not in TERMINAL:
        fields.append(f"workers {workers_up(job)}")
    fields.append(f"restarts {fraction(job.get('restarts'), job.get('max_restarts'))}")
    fields.append(f"round {text(job.get('round'))}")
    barrier = barrier_progress(job.get("barrier"), now)
    if barrier:
        fields.append(f"exit barrier {barrier}")
    if job.get("exit_code") is not None:
        fields.append(f"exit {job['exit_code']}")
    return clean("  ".join(fields))


def error_summary(error: Doc | None) -> str | None:
    """'error: <message> (rank 1 on node n1, exit code 1)', or None without an error."""
    if not error:
        return None
    rank, node, code = error.get("rank"), error.get("node"), error.get("exit_code")
    place = " ".join(
        filter(None, (f"rank {rank}" if rank is not None else None, node and f"on node {node}"))
    )
    detail = ", ".join(filter(None, (place, f"exit code {code}" if code is not None else None)))
    return clean(f"error: {text(error.get('message'))}" + (f" ({detail})" if detail else ""))


def failure_report(job: Doc, stderr_tail: Sequence[str]) -> str:
    """torchrun's kind of failure summary: the job, its root cause (time, node, rank, exit
    code or signal, message), the @record traceback, and the tail of the rank's stderr."""
    error = job.get("error") or {}
    rule, thin = "=" * 60, "-" * 60
    rank = error.get("rank")
    lines = [
        rule,
        f"{text(job.get('name') or job.get('id'))} FAILED (job {text(job.get('id'))})",
        thin,
        "Root Cause (first observed failure):",
        f"  time      : {local_time(error.get('timestamp') or job.get('ended'))}",
        f"  node      : {text(error.get('node'))}",
        f"  rank      : {text(rank)}"
        + (f" (local_rank: {error['local_rank']})" if error.get("local_rank") is not None else ""),
        f"  exitcode  : {exit_code_text(error.get('exit_code'))}",
        f"  error     : {text(error.get('message'))}",
    ]
    traceback = str(error.get("traceback") or "").rstrip("\n")
    if traceback:
        lines += ["  traceback :"] + ["    " + clean(line) for line in traceback.split("\n")]
    if stderr_tail:
        lines += [thin, f"stderr of rank {text(rank)} (last {len(stderr_tail)} lines):"]
        lines += ["  " + clean(line, keep_tabs=True) for line in stderr_tail]
    lines.append(rule)
    return "\n".join(lines)


def exit_code_text(code: Any) -> str:
    """'1', or '-9 (SIGKILL)' for a worker killed by a signal."""
    if isinstance(code, int) and code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"{code} (signal {-code})"
    return text(code)


def cancelled_line(job: Doc | None, requested: str) -> str:
    """'job j-7f3a21 cancelled', or that it had already ended some other way."""
    job = job or {}
    job_id, state = job.get("id") or requested, job.get("state")
    if state in TERMINAL - {"CANCELLED"}:
        return clean(f"job {job_id} had already ended ({state})")
    return clean(f"job {job_id} cancelled")


def job_age(job: Doc, now: float) -> str:
    """Age of an active job ('3m12s'); for a finished one, how long ago it ended."""
    if job.get("state") in TERMINAL and job.get("ended") is not None:
        return ago(job["ended"], now)
    created = job.get("created")
    return NONE if created is None else duration(now - created)


def job_state(job: Doc) -> Any:
    """A held job (a node refuses a record it needs: `held` says which and why) shows as
    HELD, with the state its parts give."""
    return f"HELD ({job.get('state')})" if job.get("held") else job.get("state")


def jobs_table(jobs: Iterable[Doc], now: float) -> str:
    headers = ("ID", "NAME", "USER", "STATE", "NODES", "ALLOC", "WORKERS", "RESTARTS", "AGE/ENDED")
    return table(
        headers,
        (
            [
                job.get("id"),
                job.get("name"),
                job.get("user"),
                job_state(job),
                f"{node_total(job)} ({text(job.get('nnodes'))})",
                allocation(job),
                workers_up(job),
                fraction(job.get("restarts"), job.get("max_restarts")),
                job_age(job, now),
            ]
            for job in jobs
        ),
    )


def allocation(job: Doc) -> str:
    """The nodes the cluster's schedule gives the job, or why it waits ('-': no schedule)."""
    if job.get("reason"):
        return f"({job['reason']})"
    return text(job["allocated"]) if "allocated" in job else NONE


QUEUE_REASONS = """\
Why a job waits (Slurm's words):
  Priority      a job ahead of it waits for the room it would take
  Resources     not enough free room, even reclaiming the nodes other jobs borrow or lend
  QuotaUser     its min would take its user over a quota ([scheduler] in the config)
  QuotaAccount  its min would take its account over a quota
  Held          a node refuses a record the job needs (`elasticctl status JOB` says which)
  Size          its min can never fit this cluster, even idle
The order: priority, then the account's fair share (usage decayed with a half-life), then age.
No start time is estimated: jobs have no time limit to estimate one from."""


def waited_from(job: Doc) -> float | None:
    """When a waiting job began to wait: its submit, or when it last stopped (preempted,
    requeued); a daemon older than that field says only the submit."""
    since = job.get("waiting_since", job.get("submitted"))
    return since if isinstance(since, (int, float)) and not isinstance(since, bool) else None


def queue_table(result: Doc, now: float) -> str:
    jobs = list(result.get("jobs") or []) if isinstance(result, Mapping) else []
    headers = ("#", "ID", "NAME", "USER", "ACCOUNT", "PRIO", "NODES", "REASON", "WAITED")
    rows = (
        [
            job.get("position"),
            job.get("id"),
            job.get("name"),
            job.get("user"),
            job.get("account") or NONE,
            job.get("priority"),
            node_count(job.get("nnodes")),
            text(job.get("reason") or NONE) + (" (preempted)" if job.get("preempted") else ""),
            NONE if (since := waited_from(job)) is None else duration(now - since),
        ]
        for job in jobs
    )
    head = (
        ""
        if result.get("scheduler")
        else "no schedule (the scheduler is off, or not heard from yet): open jobs no node runs, first come first\n"
    )
    return head + (table(headers, rows) if jobs else "no job waits")


def status_block(job: Doc, now: float) -> str:
    """Everything about one job: fields, root-cause error, exit barrier, nodes, workers."""
    user = text(job.get("user")) + (f" (uid {job['uid']})" if job.get("uid") is not None else "")
    fields = [
        ("id", job.get("id")),
        ("name", job.get("name")),
        ("user", user),
        ("state", job_state(job)),
        *([("held", job["held"])] if job.get("held") else []),
        ("command", command_text(job)),
        ("python", job.get("python") if job.get("kind") != "exec" else None),
        ("workdir", job.get("workdir")),
        ("nnodes", job.get("nnodes")),
        ("nproc", job.get("nproc_per_node")),
        ("role", job.get("role")),
        *([("master port", job["master_port"])] if job.get("master_port") else []),
        *sharing_fields(job),
        ("world size", job.get("world_size")),
        *([("spares", spares_line(job))] if job.get("spares") else []),
        *(
            [("warm restart", standbys_line(job))]
            if job.get("warm_restart") and job.get("state") not in TERMINAL
            else []
        ),
        ("restarts", fraction(job.get("restarts"), job.get("max_restarts"))),
        ("round", job.get("round")),
        ("created", local_time(job.get("created"))),
        ("started", local_time(job.get("started"))),
        ("ended", local_time(job.get("ended"))),
        ("exit code", job.get("exit_code")),
    ]
    barrier = barrier_progress(job.get("barrier"), now)
    if barrier:
        fields.append(("exit barrier", barrier))
    if job.get("checkpoint") or job.get("checkpoint_dir"):
        fields.append(("checkpoint", checkpoint_line(job.get("checkpoint"), now)))
    if job.get("checkpoint_dir"):
        fields.append(("on disk in", job["checkpoint_dir"]))
    if job.get("usage"):
        fields.append(("usage", usage_line(job["usage"])))
    fields += [("hung", cause) for cause in job.get("hung") or ()]
    lines = [f"{label + ':':<14}{text(value)}" for label, value in fields]
    lines += _error_lines(job.get("error"), hidden=bool(job.get("redacted")))
    if job.get("nodes"):
        lines += ["", nodes_of_job_table(job["nodes"])]
    if job.get("workers"):
        lines += ["", workers_table(job["workers"])]
    for node, story in sorted((job.get("story") or {}).items()):
        lines += ["", f"story on {text(node)} (seconds since its first entry):"]
        lines += [f"  {text(line)}" for line in story] or ["  (nothing: this node never took part)"]
    for node, story in sorted((job.get("node_story") or {}).items()):
        lines += ["", f"the story of node {text(node)} (seconds since its first entry):"]
        lines += [f"  {text(line)}" for line in story[-60:]] or ["  (nothing yet)"]
    return "\n".join(lines)


def checkpoint_line(checkpoint: Doc | None, now: float) -> str:
    """'step_40 (round 2, 3 ranks), 1.2 GiB, saved 4s ago; held on n1, n2; copies n1->n2,
    n2->n1; on disk': the newest complete checkpoint, as restarts would read it."""
    if not checkpoint:
        return "none complete yet"
    held = ", ".join(text(n) for n in checkpoint.get("held") or [])
    copies = ", ".join(
        f"{text(owner)}->{text(to)}" if to else f"{text(owner)}->none"
        for owner, to in sorted((checkpoint.get("copies") or {}).items())
    )
    saved = checkpoint.get("saved")
    age = "" if saved is None else f", saved {duration(max(0.0, now - saved))} ago"
    return (
        f"{text(checkpoint.get('id'))} (round {checkpoint.get('round')}, "
        f"{checkpoint.get('world')} ranks), {size(checkpoint.get('size'))}{age}; held on "
        f"{held}; copies {copies or 'none (one node)'}"
        + ("; on disk" if checkpoint.get("on_disk") else "")
    )


def spares_line(job: Doc) -> str:
    """'2 warm (up to 1 a node)': the job's parked workers now, and what it asked for."""
    warm = sum(node.get("spares") or 0 for node in job.get("nodes") or ())
    return f"{warm} warm (up to {job['spares']} a node)"


def standbys_line(job: Doc) -> str:
    """'5 standbys waiting (on 2 of 2 nodes)': --warm-restart's interpreters ready for the
    next restart's workers, as each node last said (this node's read now; a lost node's
    are gone)."""
    said = [
        node["usage"]["standbys"] if node.get("state") != "LOST" else 0
        for node in job.get("nodes") or ()
        if isinstance(node.get("usage"), dict) and isinstance(node["usage"].get("standbys"), int)
    ]
    if not said:
        return "no standby reported yet"
    waiting = sum(said)
    return (
        f"{waiting} standby{'s' if waiting != 1 else ''} waiting "
        f"(on {sum(1 for n in said if n)} of {len(job.get('nodes') or ())} nodes)"
    )


def sharing_fields(job: Doc) -> list[tuple[str, Any]]:
    """The scheduler's fields of a job where they are not the defaults: its account
    (whenever known), priority, node-count step and whether it is preemptible."""
    fields: list[tuple[str, Any]] = [("account", job["account"])] if job.get("account") else []
    if job.get("priority"):
        fields.append(("priority", job["priority"]))
    if job.get("nnodes_step") not in (None, 1):
        fields.append(("nnodes step", job["nnodes_step"]))
    if job.get("preemptible"):
        fields.append(("preemptible", "yes"))
    return fields


HIDDEN = "(shown to the job's owner and admins only)"


def command_text(job: Doc) -> str | None:
    """The command line; another user's job shows its program only (the daemon sent no more)."""
    command = " ".join(job.get("argv") or [])
    if job.get("redacted") and command:
        return f"{command} ... {HIDDEN}"
    return command or None


def _error_lines(error: Doc | None, *, hidden: bool = False) -> list[str]:
    if hidden and error:
        error = {**error, "message": f"{error.get('message') or ''}{HIDDEN}"}
    summary = error_summary(error)
    if summary is None:
        return []
    lines = [summary]
    traceback = (error or {}).get("traceback")
    if traceback:
        lines.append("traceback:")
        lines += [
            "    " + clean(line)
            for line in str(traceback).replace("\r\n", "\n").rstrip("\n").split("\n")
        ]
    return lines


def nodes_of_job_table(parts: Iterable[Doc]) -> str:
    """Each node's part of a job: which group rank, which global ranks, in what state, and
    what its processes there used."""
    return table(
        ("NODE", "GROUP RANK", "RANKS", "STATE", "CPU", "MEM PEAK"),
        (
            [
                p.get("node"),
                p.get("group_rank"),
                ranks(p.get("ranks") or []),
                p.get("state"),
                cpu_time((p.get("usage") or {}).get("cpu_seconds")),
                size((p.get("usage") or {}).get("memory_peak")),
            ]
            for p in parts
        ),
    )


def usage_line(usage: Doc) -> str:
    """'cpu 1m30s, memory peak 1.2 GiB (largest node), 1 OOM kill'."""
    parts = []
    if usage.get("cpu_seconds") is not None:
        parts.append(f"cpu {cpu_time(usage['cpu_seconds'])}")
    if usage.get("memory_peak") is not None:
        parts.append(f"memory peak {size(usage['memory_peak'])} (largest node)")
    if usage.get("oom_kills"):
        kills = usage["oom_kills"]
        parts.append(f"{kills} OOM kill{'s' if kills != 1 else ''}")
    return ", ".join(parts) or NONE


def cpu_time(seconds: Any) -> str:
    """CPU seconds: '0.42s' under a minute, else as a duration ('1m30s')."""
    if not isinstance(seconds, (int, float)):
        return NONE
    return f"{seconds:.2f}s" if seconds < 60 else duration(seconds)


def size(nbytes: Any) -> str:
    """Bytes in binary units: '512 B', '1.2 GiB'."""
    if not isinstance(nbytes, (int, float)):
        return NONE
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return NONE


def workers_table(workers: Iterable[Doc]) -> str:
    return table(
        ("RANK", "LOCAL", "NODE", "PID", "STATE", "EXIT"),
        (
            [
                w.get("rank"),
                w.get("local_rank"),
                w.get("node"),
                w.get("pid"),
                w.get("state"),
                w.get("exit_code"),
            ]
            for w in workers
        ),
    )


# -- usage ----------------------------------------------------------------------------------


def usage_tables(doc: Doc) -> str:
    """The window, then a table per user and one per account: node-, slot- and GPU-hours
    and jobs."""
    since, retention = doc.get("since"), doc.get("retention")
    start = (
        local_time(since)
        if _number(since)
        else "the oldest job known"
        + (
            f" (ended jobs are kept {duration(retention)})"
            if _number(retention) and retention > 0
            else ""
        )
    )
    lines = [
        clean(
            f"usage from {start} to {local_time(doc['until']) if _number(doc.get('until')) else NONE}"
        )
    ]
    for by in ("user", "account"):
        rows = [r for r in doc.get(f"{by}s") or [] if isinstance(r, Mapping)]
        lines += [
            "",
            table(
                (by.upper(), "NODE-HOURS", "SLOT-HOURS", "GPU-HOURS", "JOBS"),
                (
                    [
                        r.get(by),
                        hours(r.get("node_seconds")),
                        hours(r.get("slot_seconds")),
                        hours(r.get("gpu_seconds")),
                        r.get("jobs"),
                    ]
                    for r in rows
                ),
            ),
        ]
    return "\n".join(lines)


def hours(seconds: Any) -> str:
    """Seconds as hours with two decimals; '<0.01' for less that is not nothing."""
    if not _number(seconds):
        return NONE
    return "<0.01" if 0 < seconds < 36 else f"{seconds / 3600:.2f}"


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# -- nodes and logs -------------------------------------------------------------------------


def nodes_table(nodes: Iterable[Doc], now: float) -> str:
    """The nodes, then one line for each thing a node cannot bound of a job (why, and what
    it does instead)."""
    nodes = list(nodes)
    headers = (
        "NAME",
        "ADDRESS",
        "STATE",
        "SLOTS",
        "GPUS",
        "JOBS",
        "LAST SEEN",
        "CGROUP",
        "PIDS",
        "MEMORY",
    )
    lines = table(
        headers,
        (
            [
                n.get("name"),
                n.get("address"),
                node_state(n, now),
                fraction(n.get("slots_free"), n.get("slots_total")),
                fraction(n.get("gpus_free"), n.get("gpus_total")),
                ",".join(n.get("jobs") or []) or None,
                ago(n.get("last_seen"), now),
                *containment_cells(n.get("containment")),
            ]
            for n in nodes
        ),
    )
    notes = [
        clean(f"{text(n.get('name'))}: {note}")
        for n in nodes
        for note in [*_gpu_notes(n), *_notes(n.get("containment"))]
    ]
    return "\n".join([lines, "", *notes]) if notes else lines


def containment_cells(containment: Any) -> list[str]:
    """CGROUP, PIDS and MEMORY of a node: 'yes', '1024/worker', '8.0 GiB'; what bounds a
    limit when it is not the job's cgroup ('(RLIMIT_NPROC)'), or that nothing does."""
    if not isinstance(containment, Mapping):
        return [NONE] * 3  # a daemon that does not publish it
    pids, memory = containment.get("pids_per_worker"), containment.get("memory")
    pids_by, memory_by = containment.get("pids_by"), containment.get("memory_by")
    pids_cell = f"{text(pids)}/worker" if pids else "no limit"
    if pids and pids_by not in ("cgroup v2", "cgroup v1"):
        pids_cell += f" ({text(pids_by)})" if pids_by else " (not enforced)"
    memory_cell = size(memory) if memory else "no limit"
    if memory and not memory_by:
        memory_cell += " (not enforced)"
    return ["yes" if containment.get("cgroup") is True else "no", pids_cell, memory_cell]


def _gpu_notes(node: Doc) -> list[str]:
    """'gpus 7/8, gpu 3: xid 79': the GPUs offered of all, and each one taken out as bad."""
    out = node.get("gpus_out")
    if not isinstance(out, Mapping) or not out:
        return []
    offered = node.get("gpus_total")
    whole = (
        offered + len(out) if isinstance(offered, int) and not isinstance(offered, bool) else None
    )
    why = ", ".join(f"gpu {text(index)}: {text(reason)}" for index, reason in out.items())
    return [f"gpus {text(offered)}/{text(whole)}, {why}"]


def _notes(containment: Any) -> list[str]:
    notes = containment.get("missing") if isinstance(containment, Mapping) else None
    return (
        [text(note) for note in notes if isinstance(note, str)] if isinstance(notes, list) else []
    )


def node_state(node: Doc, now: float) -> str | None:
    """'up'; 'blacklisted (42s left)' (by the node's clock, so roughly); 'drained (not
    listed)' for a node that the discovery script does not list."""
    state = node.get("state")
    until = node.get("blacklisted_until")
    if (
        state == "blacklisted"
        and isinstance(until, (int, float))
        and not isinstance(until, bool)
        and math.isfinite(until)
    ):
        return f"{state} ({duration(until - now)} left)"
    if state in ("draining", "drained") and node.get("listed") is False:
        return f"{state} (not listed)"
    return state


def node_changed_line(node: Doc | None, name: str, op: str) -> str:
    """'node n1 draining' from the node document, or that the change was requested."""
    state = (node or {}).get("state")
    return clean(f"node {name} {state}" if state else f"node {name}: {op} requested")


def daemon_version_line(version: Doc | None) -> str:
    version = version or {}
    line = f"elasticd {text(version.get('version'))} on node {text(version.get('node'))}"
    if version.get("store"):
        state = "reachable" if version.get("store_up") else "UNREACHABLE"
        line += f", cluster {text(version.get('cluster'))}, store {version['store']} {state}"
    return clean(line)


def log_line(line: Doc) -> str:
    """'[rank 0] text' for stdout, '[rank 0 err] text' for stderr; after a restart the
    attempt shows too: '[rank 0 attempt 1] text'.  Tabs in the text are kept."""
    tags = [f"rank {text(line.get('rank'))}"]
    if line.get("attempt"):
        tags.append(f"attempt {line['attempt']}")
    if line.get("stream") == "err":
        tags.append("err")
    body = str(line.get("text", "")).removesuffix("\n")
    return clean(f"[{' '.join(tags)}] ") + clean(body, keep_tabs=True)
