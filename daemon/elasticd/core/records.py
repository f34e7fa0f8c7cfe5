"""Job records, pure: a job is its spec, its submit order (``seq``), one *part* per node that
takes part in it (reported by that node's agent) and, once decided, its *outcome*.  The
job's state and the documents that ``elasticctl`` shows are derived from these; the
registry (:mod:`elasticd.jobs.registry`) holds them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from elasticd.core import checkpoints
from elasticd.core.model import Failure, JobSpec, JobState, PartState, WorkerState
from elasticd.wire.numbers import json_int, json_number

log = logging.getLogger(__name__)

LOST = "LOST"  # what a lost node's running part and workers show (their node can no longer say)
WARMING = "WARMING"  # a part in no round yet whose workers run (in place: they warm up)


@dataclass(frozen=True)
class Part:
    node: str
    state: PartState
    round: int | None = None
    group_rank: int | None = None
    restarts: int = 0
    world_size: int | None = None
    group_world_size: int | None = None
    workers: tuple[dict[str, Any], ...] = ()
    started: float | None = None
    barrier: dict[str, Any] | None = None
    updated: float = 0.0
    usage: dict[str, Any] | None = None  # the job's cgroup on this node: cgroups.Usage.to_json()
    held: str = (
        ""  # why this node holds the job (it refuses a record the job needs): every node shows it
    )
    # What core/usage.py charges (None: a part of a daemon older than these fields): when this
    # part's workers first ran a round (wall clock; ``started`` is the job's first start, on
    # any node), the slots and GPUs it holds, and the spans of this node's earlier parts of
    # the job, (ran, ended, slots, gpus) each, which the registry carries (one part per node).
    ran: float | None = None
    slots: int | None = None
    gpus: int | None = None
    spares: int = 0  # in place: warm workers parked beside the placed ones (asked, no place)
    hung: str = ""  # the root cause of the last hang this node found (core/hang.py's cause)
    before: tuple[tuple[float, float, int, int], ...] = ()
    # this node's share of the job's newest checkpoints (core/checkpoints.py's manifests)
    checkpoints: tuple[dict[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["state"] = self.state.value
        doc["workers"] = list(self.workers)
        doc["before"] = [list(span) for span in self.before]
        doc["checkpoints"] = list(self.checkpoints)
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Part:
        fields = {k: doc[k] for k in cls.__dataclass_fields__ if k in doc}
        fields["state"] = PartState(fields["state"])
        fields["workers"] = tuple(fields.get("workers", ()))
        fields["before"] = tuple(tuple(span) for span in fields.get("before") or ())
        fields["checkpoints"] = tuple(fields.get("checkpoints") or ())
        return cls(**fields)


@dataclass(frozen=True)
class Outcome:
    """How a job ended; written once (the first writer wins)."""

    state: JobState
    ended: float
    exit_code: int | None = None
    message: str = ""
    error: Failure | None = None
    by: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "ended": self.ended,
            "exit_code": self.exit_code,
            "message": self.message,
            "by": self.by,
            "error": self.error.to_json() if self.error else None,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Outcome:
        state = JobState(doc["state"])
        if not state.terminal:
            raise ValueError(f"outcome state {state.value} is not terminal")
        error = Failure.from_json(doc["error"]) if doc.get("error") else None
        return cls(
            state,
            json_number(doc["ended"], "ended"),
            doc.get("exit_code"),
            str(doc.get("message", "")),
            error,
            str(doc.get("by", "")),
        )


@dataclass(frozen=True)
class JobRecord:
    spec: JobSpec
    seq: int
    parts: Mapping[str, Part] = field(default_factory=dict)
    outcome: Outcome | None = None
    version: int = 0
    held: str = ""  # why this node never places the job again (it refuses a record the job needs)

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def state(self) -> JobState:
        return job_state(self.parts.values(), self.outcome)

    def with_part(self, part: Part) -> JobRecord:
        return replace(self, parts={**self.parts, part.node: part}, version=self.version + 1)


def expired(outcome: Outcome | None, now: float, retention: float) -> bool:
    """Whether a job that ended with ``outcome`` ended ``retention`` seconds ago or more
    (retention 0: never; a job without an outcome never)."""
    return retention > 0 and outcome is not None and outcome.ended <= now - retention


def job_state(parts: Iterable[Part], outcome: Outcome | None) -> JobState:
    """The job's state from its nodes' parts; an outcome, once written, is final.  A job that
    ran and has no running node is RESTARTING, even while no node holds it (JOB_STATES)."""
    if outcome is not None:
        return outcome.state
    parts = list(parts)
    states = {p.state for p in parts}
    if states & {PartState.RUNNING, PartState.BARRIER}:
        return JobState.RUNNING
    if PartState.RESTARTING in states or started(parts) is not None:
        return JobState.RESTARTING
    if PartState.RENDEZVOUS in states:
        return JobState.RENDEZVOUS
    return JobState.PENDING


def hold_reason(record: JobRecord) -> str:
    """Why the job is held ("": it is not): each node that refuses a record the job needs
    (its outcome, or a rendezvous state nobody could restore) says why in its part, so every
    node shows it; this node's own reason stands until its part says it.  An ended job is not
    held (a valid outcome, a cancel, replaced what was refused)."""
    if record.outcome is not None:
        return ""
    reasons = sorted((p.node, p.held) for p in record.parts.values() if p.held)
    return "; ".join(f"{node}: {why}" for node, why in reasons) or record.held


def started(parts_or_record: Iterable[Part] | JobRecord) -> float | None:
    """When the job first ran, on any node (None: it has not)."""
    parts = (
        parts_or_record.parts.values()
        if isinstance(parts_or_record, JobRecord)
        else parts_or_record
    )
    return min((p.started for p in parts if p.started is not None), default=None)


@dataclass(frozen=True)
class WorkerGroupLeft:
    """A process group a worker of a daemon that died may have left: whose it is."""

    job_id: str
    uid: int
    started: float  # when the job's part started here (wall clock)


def worker_groups(records: Iterable[JobRecord], node: str) -> dict[int, WorkerGroupLeft]:
    """The process groups of the workers ``node`` ran for these jobs (a worker's pid, its
    group's id -> whose), for reaping what a daemon that died left behind."""
    return {
        json_int(worker["pid"], "pid"): WorkerGroupLeft(record.id, record.spec.uid, part.started)
        for record in records
        if (part := record.parts.get(node)) is not None and part.started
        for worker in part.workers
        if worker.get("pid")
    }


def current_parts(record: JobRecord) -> list[Part]:
    """The parts of the latest round (older rounds' workers are gone), by group rank, and
    the parts in no round yet whose workers run (in place: warming up, charged)."""
    rounds = [p.round for p in record.parts.values() if p.round is not None]
    latest = max(rounds, default=None)
    parts = [
        p
        for p in record.parts.values()
        if p.state != PartState.LEFT and (p.round == latest or warming(p))
    ]
    return sorted(parts, key=lambda p: (p.group_rank is None, p.group_rank or 0, p.node))


def warming(part: Part) -> bool:
    """An in-place part in no round yet whose workers run: they warm up."""
    return (
        part.round is None
        and part.state is PartState.RENDEZVOUS
        and any(w.get("pid") for w in part.workers)
    )


def job_doc(
    record: JobRecord, live_usage: Mapping[str, Any] | None = None, lost: Collection[str] = ()
) -> dict[str, Any]:
    """The job document of the control protocol (``status --json``).  ``live_usage`` is
    this node's usage of the job read now, fresher than its last reported part; ``lost``
    the nodes judged lost, whose last word about a running job is no longer true."""
    spec, outcome = record.spec, record.outcome
    parts = current_parts(record)
    gone = (
        {p.node for p in parts if p.node in lost and p.state.active} if outcome is None else set()
    )
    parts = [as_lost(p) if p.node in gone else p for p in parts]
    usage = {p.node: p.usage for p in record.parts.values() if p.usage}
    if live_usage:
        usage.update(live_usage)
    error = _error_doc(outcome)
    barrier = next((p.barrier for p in parts if p.barrier), None)
    return {
        **_summary(record, parts),
        "role": spec.role,
        "master_port": spec.master_port or None,
        "argv": list(spec.argv),
        "kind": spec.kind,
        "python": spec.python,
        "workdir": spec.workdir,
        "submitted_on": spec.submitted_on,
        "priority": spec.priority,
        "account": spec.account,
        "preemptible": spec.preemptible,
        "nnodes_step": spec.nnodes_step,
        "spares": spec.spares,
        "warm_restart": spec.warm_restart,
        "workers": sorted((w for p in parts for w in p.workers), key=lambda w: w["rank"]),
        "nodes": [_node_doc(p, usage.get(p.node), p.node in gone) for p in parts],
        "usage": total_usage(usage.values()),
        "error": error,
        "barrier": barrier if outcome is None else None,
        "held": hold_reason(record) or None,
        "checkpoint_dir": spec.checkpoint_dir or None,
        "checkpoint": checkpoints.summary(
            checkpoints.manifests((p.node, p.checkpoints) for p in record.parts.values())
        ),
        # every node's last hang, not only the newest round's: the hang that restarted the
        # job is why it restarted, and the node that failed the rank may not have rejoined
        "hung": [p.hung for p in sorted(record.parts.values(), key=lambda p: p.node) if p.hung],
        "redacted": False,
    }


def _summary(record: JobRecord, parts: list[Part]) -> dict[str, Any]:
    """What a job's document and its ``list`` row both say of it."""
    spec, outcome = record.spec, record.outcome
    return {
        "id": spec.id,
        "name": spec.name,
        "state": record.state.value,
        "user": spec.user,
        "uid": spec.uid,
        "seq": record.seq,
        "nnodes": spec.nnodes,
        "nproc_per_node": spec.nproc_per_node,
        "restarts": max((p.restarts for p in record.parts.values()), default=0),
        "max_restarts": spec.max_restarts,
        "created": spec.created,
        "started": started(record),
        "ended": outcome.ended if outcome else None,
        "exit_code": outcome.exit_code if outcome else None,
        "round": parts[0].round if parts else None,
        "world_size": parts[0].world_size if parts else None,
    }


def others_view(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A job document as users other than its owner, root and the admin group see it: the
    program (``argv[0]``) without its arguments, no environment, and where and how the job
    failed (rank, node, exit code) without the error's text or traceback, which may hold
    what the owner did not mean to show (a password in a command line or an exception)."""
    shown = {name: value for name, value in doc.items() if name not in ("env", "checkpoint_dir")}
    shown["argv"] = list(doc.get("argv") or [])[:1]
    if doc.get("error"):
        shown["error"] = {**doc["error"], "message": "", "traceback": ""}
    if doc.get("hung"):  # which rank hung, not where in its code
        shown["hung"] = ["a rank hung (its node failed it; the job's owner sees which)"] * len(
            doc["hung"]
        )
    shown["redacted"] = True
    return shown


def list_row(record: JobRecord) -> dict[str, Any]:
    """One job's row in ``list``, the same for every caller: what the table shows and no
    more (no arguments, environment, error text or per-worker detail), so a row's size does
    not grow with what a user submitted or with the job's size."""
    parts = current_parts(record)
    workers = [w for p in parts for w in p.workers]
    return {
        **_summary(record, parts),
        "kind": record.spec.kind,
        "node_count": len(parts),
        "workers_up": sum(w.get("state") == WorkerState.HEALTHY for w in workers),
        "workers_total": len(workers),
        "held": hold_reason(record) or None,
    }


def listed_doc(record: JobRecord) -> dict[str, Any]:
    """list_row for `list`: a record that cannot be rendered still shows, marked, and never
    fails the whole list for everyone."""
    try:
        return list_row(record)
    except Exception:
        log.exception("job %s cannot be shown", record.id)
        return {
            "id": record.id,
            "name": "?",
            "state": "UNKNOWN",
            "user": "?",
            "nnodes": None,
            "node_count": 0,
            "workers_up": 0,
            "workers_total": 0,
            "unreadable": True,
        }


def as_lost(part: Part) -> Part:
    """A running part of a lost node as it is shown: its workers LOST, not what its node
    said last (HEALTHY, while it ran)."""
    return replace(part, workers=tuple({**w, "state": LOST} for w in part.workers))


def _node_doc(part: Part, usage: Mapping[str, Any] | None, lost: bool = False) -> dict[str, Any]:
    return {
        "node": part.node,
        "group_rank": part.group_rank,
        "state": LOST if lost else WARMING if warming(part) else part.state.value,
        "ranks": [w["rank"] for w in part.workers if w["rank"] >= 0],
        "spares": part.spares,
        "usage": dict(usage) if usage else None,
    }


def total_usage(usages: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """A job's usage over its nodes: CPU time and OOM kills add up, the memory peak is the
    largest node's (peaks on different nodes need not coincide)."""
    usages = list(usages)
    if not usages:
        return None

    def values(key: str) -> list[Any]:
        return [u[key] for u in usages if u.get(key) is not None]

    total = {
        "cpu_seconds": sum(values("cpu_seconds")) if values("cpu_seconds") else None,
        "memory_peak": max(values("memory_peak"), default=None),
        "oom_kills": sum(values("oom_kills")) if values("oom_kills") else None,
    }
    return {key: value for key, value in total.items() if value is not None}


def _error_doc(outcome: Outcome | None) -> dict[str, Any] | None:
    if outcome is None or outcome.state == JobState.SUCCEEDED:
        return None
    if outcome.error is not None:
        doc = outcome.error.to_json()
        doc["message"] = doc["message"] or outcome.message
        return doc
    return {
        "message": outcome.message,
        "traceback": "",
        "rank": None,
        "node": outcome.by,
        "exit_code": outcome.exit_code,
    }


def history_row(record: JobRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "seq": record.seq,
        "state": record.state.value,
        "created": record.spec.created,
        "ended": record.outcome.ended if record.outcome else None,
        "spec": record.spec.to_json(),
        "parts": {n: p.to_json() for n, p in record.parts.items()},
        "outcome": record.outcome.to_json() if record.outcome else None,
    }


def record_from_history(doc: Mapping[str, Any]) -> JobRecord:
    if not isinstance(doc, Mapping):
        raise ValueError("the row is not a JSON object")
    outcome = Outcome.from_json(doc["outcome"]) if doc.get("outcome") else None
    parts = {n: Part.from_json(p) for n, p in (doc.get("parts") or {}).items()}
    return JobRecord(JobSpec.from_json(doc["spec"]), json_int(doc["seq"], "seq"), parts, outcome)
