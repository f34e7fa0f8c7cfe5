"""The part's policy, pure: what to do about what a running round learns (``decide``), and
the words and outcomes that go with it.  Shared by the classic and the in-place machine."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from elasticd.core.events import JobEnded, Leaving
from elasticd.core.model import Failure, JobSpec, JobState, RunResult, WorkerGroup, WorkerState
from elasticd.core.records import Outcome
from elasticd.journal import excerpt
from elasticd.rendezvous import EventKind, Reason, RendezvousInfo, RoundEvent, may_restart


class Decision(enum.Enum):
    """What the part does about an event of its round (``decide``)."""

    BARRIER = "barrier"  # local workers succeeded: wait for the other nodes
    RESTART = "restart"  # a worker failed and restarts remain: open a new round ("failure")
    NODE_LOST = "node_lost"  # workers failed because a member node died: re-form without it
    FAIL = "fail"  # a worker failed and no restarts remain
    REJOIN = "rejoin"  # the round was superseded: stop and join the next one
    SCALE_UP = "scale_up"  # nodes (or warmed workers) wait and the job is below max
    WATCH = "watch"  # nothing to do: keep watching
    STOP = "stop"  # the job ended: stop
    LEAVE = "leave"  # this node leaves the job (drain, shutdown)
    STALL = "stall"  # in place: a survivor did not rejoin in time; restart every worker
    # in place: a carried worker died before its place: the failure that opened this round,
    # seen late, or one its old round's end left stuck (GIVEN_UP_EXIT): re-form, uncharged
    LATE_EXIT = "late_exit"


# -- what a round's watch can learn (the inputs of ``decide``) ------------------------------------


# A worker's exit status when elastic's runtime gave its round up: an abort its collective did
# not end, or a forming superseded (elastic.runtime.GIVEN_UP_EXIT; EX_TEMPFAIL)
GIVEN_UP_EXIT = 75


@dataclass(frozen=True)
class WorkersExited:
    result: RunResult
    lost: tuple[str, ...] = ()  # members whose daemon was found dead when the workers failed
    # in place: every worker that failed was carried into this round and died before it took
    # its place there (it was dying when its peers' broken collective opened the round)
    carried: bool = False

    @property
    def gave_up(self) -> bool:
        """Every worker that failed ended itself because its round was given up."""
        failures = self.result.failures
        return bool(failures) and all(f.exit_code == GIVEN_UP_EXIT for f in failures)


@dataclass(frozen=True)
class WorkersReady:
    """In place: workers that warmed up and asked for a place."""

    slots: tuple[int, ...]


@dataclass(frozen=True)
class RejoinStalled:
    """In place: survivors that did not ask for their place in time."""

    slots: tuple[int, ...]


Observed = WorkersExited | WorkersReady | RejoinStalled | JobEnded | Leaving | RoundEvent


def decide(seen: Observed, info: RendezvousInfo, spec: JobSpec) -> Decision:
    """The part's policy: what to do about ``seen`` in the round ``info``."""
    if isinstance(seen, JobEnded):
        return Decision.STOP
    if isinstance(seen, Leaving):
        return Decision.LEAVE
    if isinstance(seen, WorkersReady):
        return Decision.SCALE_UP
    if isinstance(seen, RejoinStalled):
        return Decision.STALL
    if isinstance(seen, WorkersExited):
        if seen.result.state == WorkerState.SUCCEEDED:
            return Decision.BARRIER
        if seen.lost:
            return Decision.NODE_LOST  # a membership change: no restart is charged
        if seen.carried and info.reason is Reason.FAILURE:
            return Decision.LATE_EXIT  # the failure this round was opened for: charged once
        if seen.carried and seen.gave_up:
            return Decision.LATE_EXIT  # its old round's end, a membership change: not charged
        return (
            Decision.RESTART
            if may_restart(info.restart_count, spec.max_restarts)
            else Decision.FAIL
        )
    if seen.kind is EventKind.CLOSED:
        return Decision.STOP
    if seen.kind is EventKind.NEXT_ROUND:
        return Decision.REJOIN
    if seen.kind is EventKind.WAITING and len(info.members) < spec.max_nodes:
        return Decision.SCALE_UP
    return Decision.WATCH


ROUND_FOR = {
    Decision.RESTART: Reason.FAILURE,
    Decision.NODE_LOST: Reason.NODE_LOST,
    Decision.SCALE_UP: Reason.SCALE_UP,
    Decision.STALL: Reason.STALLED,
    Decision.LATE_EXIT: Reason.LATE_EXIT,
}


def describe(seen: Observed) -> str:
    """One line for the daemon's log (a job's own text in it is capped by the log's formatter)."""
    if isinstance(seen, WorkersExited):
        cause = seen.result.root_cause
        lost = f" (node {', '.join(seen.lost)} is gone)" if seen.lost else ""
        return (
            f"rank {cause.rank} failed: {excerpt(cause.message)}{lost}"
            if cause
            else "workers succeeded"
        )
    if isinstance(seen, RoundEvent):
        detail = seen.reason or (f"{seen.waiting} waiting" if seen.waiting else "")
        return f"rendezvous: {seen.kind}" + (f" ({detail})" if detail else "")
    if isinstance(seen, JobEnded):
        return f"job ended: {seen.outcome.state.value}"
    if isinstance(seen, WorkersReady):
        return f"workers in slots {list(seen.slots)} are ready"
    if isinstance(seen, RejoinStalled):
        return f"workers in slots {list(seen.slots)} did not rejoin"
    return f"leaving: {seen.reason}"


def failure_outcome(result: RunResult, spec: JobSpec, wall: float, node: str) -> Outcome:
    cause = result.root_cause
    budget = f"(max restarts {spec.max_restarts} exhausted)" if spec.max_restarts else ""
    message = (
        f"rank {cause.rank} on {cause.node}: {cause.message} {budget}".strip()
        if cause
        else "failed"
    )
    return Outcome(JobState.FAILED, wall, cause.exit_code if cause else 1, message, cause, node)


def run_result(group: WorkerGroup, failures: tuple[Failure, ...]) -> RunResult | None:
    """How the workers ended, once they have: the first failure is enough; success takes
    them all (None: they run on)."""
    failed = [w.local_rank for w in group.workers if w.state is WorkerState.FAILED]
    if failed:
        causes = tuple(f for f in failures if f.local_rank in failed)
        return RunResult(
            WorkerState.FAILED,
            causes
            or tuple(
                Failure(w.rank, w.local_rank, w.node, w.exit_code or 1, "failed")
                for w in group.workers
                if w.local_rank in failed
            ),
        )
    if group.workers and all(w.state is WorkerState.SUCCEEDED for w in group.workers):
        return RunResult(WorkerState.SUCCEEDED)
    return None
