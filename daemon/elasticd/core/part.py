"""One node's share of one job (a *part*): torchelastic's SimpleElasticAgent as a state
machine, with three fixes (docs/architecture.md).

    join -> start workers -> watch -> (restart | re-form | scale up | exit barrier) -> end

1. A worker failure anywhere opens a new round of the job's rendezvous, so every node
   stops its workers and re-forms at once; nobody hangs in a collective.
2. The restart budget is job-wide: it lives in the rendezvous state.
3. A dead node is seen by heartbeat (or found gone when workers fail); the survivors
   re-form within seconds, and no restart is spent on it.

An in-place job (``--in-place``) is a policy of the same machine (core/inplace.py): the
survivors keep their processes across rounds, missing workers warm up before their node
offers them to a round.

Pure: ``handle(event, now)`` changes the part and returns instructions; nothing here waits,
reads a clock or touches a process.  Each phase lists the events it takes (PART_EVENTS);
anything else raises IllegalTransition and changes nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elasticd.core import events as ev
from elasticd.core import inplace, spares
from elasticd.core import instructions as do
from elasticd.core.model import (
    PART_STATES,
    Failure,
    JobSpec,
    JobState,
    PartState,
    RunResult,
    StateTable,
    WorkerGroup,
    WorkerState,
    assign_workers,
)
from elasticd.core.policy import (
    ROUND_FOR,
    Decision,
    JobEnded,
    Leaving,
    Observed,
    RejoinStalled,
    WorkersExited,
    decide,
    describe,
    failure_outcome,
    run_result,
)
from elasticd.core.records import Outcome, Part
from elasticd.core.story import Story
from elasticd.core.tables import EventTable
from elasticd.rendezvous import CHARGED, EventKind, NextRound, Reason, RendezvousInfo

Instructions = list[do.Instruction]


class Phase(enum.StrEnum):
    STARTING = "starting"  # made; its first instructions not given yet
    WARMING = "warming"  # in place: workers run, not all asked for a place yet
    JOINING = "joining"  # a join of the job's round runs
    RUNNING = "running"  # workers up; the round is watched
    PROBING = "probing"  # workers failed: are members' daemons gone?
    STOPPING = "stopping"  # workers are being stopped; ``_then`` says what follows
    REQUESTING = "requesting"  # a new round was asked for
    BARRIER = "barrier"  # at the exit barrier, waiting for the other members
    FINISHING = "finishing"  # the job's outcome is being written
    LEAVING = "leaving"  # telling the rendezvous that this node leaves
    CLOSING = "closing"  # the part's effectors are being closed: nothing more to do


# A part looks at the job's end and at its own leaving whenever it is about to join or
# watch a round: from wherever it goes on to the next round, it may end or leave instead.
_NEXT = (Phase.JOINING, Phase.WARMING, Phase.LEAVING, Phase.FINISHING, Phase.CLOSING)
PART_PHASES = StateTable(
    "a part's phase",
    {
        Phase.STARTING: _NEXT,
        Phase.WARMING: (
            Phase.REQUESTING,
            *_NEXT,
        ),  # REQUESTING: a warm-up failed, a restart is spent
        Phase.JOINING: (Phase.RUNNING, *_NEXT),
        Phase.RUNNING: (Phase.PROBING, Phase.STOPPING, Phase.REQUESTING, *_NEXT),
        Phase.PROBING: (Phase.RUNNING, Phase.STOPPING, Phase.REQUESTING, *_NEXT),
        Phase.STOPPING: (Phase.REQUESTING, Phase.BARRIER, *_NEXT),
        Phase.REQUESTING: _NEXT,
        Phase.BARRIER: _NEXT,
        Phase.FINISHING: (Phase.CLOSING,),
        Phase.LEAVING: (Phase.CLOSING,),
        Phase.CLOSING: (),
    },
)


@dataclass
class Then:
    """What a part does once the operation it waits for is done."""

    decision: Decision | None = None
    seen: Observed | None = None
    reason: Reason | None = None
    state: PartState | None = None  # the part state to end in (after a finish)
    on_store_failure: PartState = PartState.LEFT
    new_pool: bool = False  # in place: start over with a fresh pool (a stall)


@dataclass
class Settings:
    """What the part needs of its node."""

    node: str
    dead_after: float  # seconds after which a silent member counts as dead


@dataclass
class PartCore:
    """One job on this node.  Its fields are the part's whole state."""

    spec: JobSpec
    nproc: int
    gpus: tuple[str, ...]
    settings: Settings
    started: float | None = None  # when the job first ran, on any node (wall clock)
    ran: float | None = None  # when this part's workers first ran a round (what usage charges)
    phase: Phase = Phase.STARTING
    info: RendezvousInfo | None = None  # the round this node's workers are (or were) in
    group: WorkerGroup | None = None  # the workers, as last heard
    failures: tuple[Failure, ...] = ()
    reported: PartState | None = None  # as last published (PART_STATES)
    report_state: PartState = PartState.RENDEZVOUS  # the state a workers' change is published in
    ended: Outcome | None = None  # the job's outcome, once heard
    leaving: Reason | None = None  # this node was asked to leave the job
    declined: str = ""  # why this node left on its own (not placed again until the job changes)
    held: str = ""  # why this node never takes the job again
    notice_waiting: bool = True  # a round at its max stops listening to waiting nodes
    scheduled: frozenset[str] = (
        frozenset()
    )  # the nodes the cluster's schedule gives the job (none: no schedule)
    spares: int = 0  # in place: slots beyond ``nproc`` for warm spare workers
    then: Then = field(default_factory=Then)
    ops: dict[str, int] = field(default_factory=dict)  # what runs: "main", "watch", "probe" -> op
    next_op: int = 0
    since: float = 0.0  # when the running join or barrier wait began (monotonic)
    barrier_deadline: float = 0.0  # wall clock, shown
    story: Story = field(default_factory=Story)
    place: inplace.Places | None = None  # an in-place job's slots (None: classic)
    finish_with: tuple[RendezvousInfo | None, WorkerGroup | None] = (
        None,
        None,
    )  # the report at the end

    # -- entry points ------------------------------------------------------------------------

    @property
    def job(self) -> str:
        return self.spec.id

    @property
    def in_place(self) -> bool:
        return self.place is not None

    def start(self, now: ev.Now) -> Instructions:
        """The part's first instructions (its effectors are made by StartPart before these)."""
        out: Instructions = []
        if self.in_place:
            return self._told("start", now, inplace.begin(self, now))
        out += self._report(PartState.RENDEZVOUS, now)
        out += self._join(now)
        return self._told("start", now, out)

    def handle(self, event: ev.PartEvent, now: ev.Now) -> Instructions:
        self.story.heard(now.mono, event)
        if not self._current(event):
            return []
        handler = PART_EVENTS.lookup(self.phase, event)
        out = handler(self, event, now) if handler is not IGNORE else []
        return self._told(type(event).__name__, now, out)

    def job_ended(self, outcome: Outcome, now: ev.Now) -> Instructions:
        """The job's outcome reached this node (from the board, or from its own finish)."""
        if self.ended is not None:
            return []
        self.story.heard(now.mono, JobEnded(outcome))
        self.ended = outcome
        return self._told("ended", now, ENDED_IN[self.phase](self, now))

    def leave(self, reason: Reason, now: ev.Now) -> Instructions:
        """This node leaves the job (a drain, a shutdown, its user kept off it)."""
        if self.leaving is not None:
            return []
        self.story.heard(now.mono, Leaving(reason))
        self.leaving = reason
        return self._told("leave", now, LEAVE_IN[self.phase](self, now))

    def nodes_lost(self, nodes: tuple[str, ...], now: ev.Now) -> Instructions:
        """Members of this part's round are gone: in a running round, the survivors re-form at once."""
        lost = tuple(
            n
            for n in nodes
            if n != self.settings.node
            and self.info is not None
            and n in {m.node for m in self.info.members}
        )
        if not lost or self.phase is not Phase.RUNNING:
            return []
        self.story.heard(now.mono, ev.NodesLost(lost))
        seen = WorkersExited(RunResult(WorkerState.FAILED, ()), lost)
        assert self.info is not None
        say = do.Say(
            "info",
            "job %s round %d: node %s is gone -> %s",
            self.job,
            (self.job, self.info.round, ", ".join(lost), Decision.NODE_LOST.value),
        )
        return self._told("lost", now, [say] + self._act(Decision.NODE_LOST, seen, now))

    # -- operations ----------------------------------------------------------------------------

    def _op(self, role: str) -> int:
        self.next_op += 1
        self.ops[role] = self.next_op
        return self.next_op

    def _current(self, event: ev.PartEvent) -> bool:
        """Whether ``event`` is news: not the completion of an operation given up on."""
        op = getattr(event, "op", None)
        return op is None or op in self.ops.values()

    def _done(self, event: Any) -> None:
        self.ops = {role: op for role, op in self.ops.items() if op != event.op}

    def _drop(self, *roles: str) -> Instructions:
        """Give up on what runs in ``roles`` (all of them when none is named)."""
        out: Instructions = []
        for role in roles or tuple(self.ops):
            op = self.ops.pop(role, None)
            if op is not None:
                out.append(do.Cancel(self.job, op))
        return out

    def _to(self, phase: Phase) -> None:
        self.phase = PART_PHASES.check(self.phase, phase)

    def _told(self, why: str, now: ev.Now, out: Instructions) -> Instructions:
        self.story.told(now.mono, why, out)
        return out

    # -- reports -------------------------------------------------------------------------------

    def _report(
        self,
        state: PartState,
        now: ev.Now,
        info: RendezvousInfo | None = None,
        group: WorkerGroup | None = None,
        barrier: dict[str, Any] | None = None,
    ) -> Instructions:
        self.report_state = PART_STATES.check(self.reported, state)
        self.reported = state
        self.ran = now.wall if self.ran is None and state is PartState.RUNNING else self.ran
        in_round = (
            dict(
                round=info.round,
                group_rank=info.group_rank,
                restarts=info.restart_count,
                world_size=info.world_size,
                group_world_size=info.group_world_size,
            )
            if info
            else {}
        )
        return [
            do.Publish(
                self.job,
                Part(
                    node=self.settings.node,
                    state=state,
                    **in_round,
                    started=self.started,
                    barrier=barrier,
                    workers=tuple(w.to_json() for w in group.workers) if group else (),
                    updated=now.wall,
                    held=self.held,
                    ran=self.ran,
                    slots=self.nproc + self.spares,
                    gpus=len(self.gpus) - len(spares.given_gpus(self)),
                    spares=inplace.parked(self) if self.place is not None else 0,
                ),
            )
        ]

    def _close(self) -> Instructions:
        self._to(Phase.CLOSING)
        return self._drop() + [do.ClosePart(self.job)]

    def _end(
        self,
        state: PartState,
        now: ev.Now,
        info: RendezvousInfo | None = None,
        group: WorkerGroup | None = None,
    ) -> Instructions:
        return self._report(state, now, info, group) + self._close()

    # -- joining ---------------------------------------------------------------------------------

    def _join(self, now: ev.Now, nproc: int | None = None) -> Instructions:
        """Join the next round; the job's end or this node's leaving comes first."""
        if self.ended is not None:
            return self._end(PartState.STOPPED, now)
        if self.leaving is not None:
            return self._leave(now, None, None)
        self._to(Phase.JOINING)
        self.since = now.mono
        return [
            do.Join(
                self.job,
                self._op("main"),
                self.nproc if nproc is None else nproc,
                self.spec.master_port,
                tuple(sorted(self.scheduled)),
            )
        ]

    def _joined(self, event: ev.RoundJoined, now: ev.Now) -> Instructions:
        self._done(event)
        info = event.info
        out: Instructions = [do.Count("round_joined", info.reason.value, now.mono - self.since)]
        if self.in_place:
            return out + inplace.joined(self, info, now)
        group = assign_workers(
            self.job,
            self.settings.node,
            round=info.round,
            restart_count=info.restart_count,
            group_rank=info.group_rank,
            group_world_size=info.group_world_size,
            rank_base=info.rank_base,
            world_size=info.world_size,
            nproc=info.nproc,
            master_addr=info.master_addr,
            master_port=info.master_port,
            gpus=self.gpus,
        )
        self.info, self.group, self.failures = info, group, ()
        self.started = self.started or now.wall
        out += self._report(PartState.RUNNING, now, info, group)
        out.append(do.StartWorkers(self.job, group, info.round))
        return out + self._watch(now, notice_waiting=True)

    def _join_failed(self, event: ev.JoinFailed, now: ev.Now) -> Instructions:
        self._done(event)
        if event.kind == ev.JoinFailure.CLOSED:
            return self._end(PartState.STOPPED, now)
        if event.kind == ev.JoinFailure.GONE:
            self.declined = self.held = (
                "its rendezvous state is gone or was refused, and no member restored it"
            )
            return [
                do.Say(
                    "warning",
                    "job %s: not starting it on %s: %s",
                    self.job,
                    (self.job, self.settings.node, event.message),
                ),
                do.HoldJob(self.job, self.held),
            ] + self._end(PartState.LEFT, now)
        outcome = Outcome(JobState.FAILED, now.wall, None, event.message, None, self.settings.node)
        return self._finish(outcome, PartState.FAILED, now)

    # -- a round ---------------------------------------------------------------------------------

    def _watch(self, now: ev.Now, notice_waiting: bool | None = None) -> Instructions:
        """Watch the round; the job's end or this node's leaving, heard already, first."""
        assert self.info is not None
        if notice_waiting is not None:
            self.notice_waiting = notice_waiting
        self._to(Phase.RUNNING)
        if self.ended is not None:
            return self._observed(JobEnded(self.ended), now)
        if self.leaving is not None:
            return self._observed(Leaving(self.leaving), now)
        return [do.Watch(self.job, self._op("watch"), self.info.round, self.notice_waiting)]

    def _observed(self, seen: Observed, now: ev.Now) -> Instructions:
        """Decide about ``seen`` in the round, and act."""
        assert self.info is not None
        decision = decide(seen, self.info, self.spec)
        say = do.Say(
            "info",
            "job %s round %d: %s -> %s",
            self.job,
            (self.job, self.info.round, describe(seen), decision.value),
        )
        if decision is Decision.WATCH:
            return [say] + self._watch(now, notice_waiting=False)
        return [say] + self._act(decision, seen, now)

    def _round_changed(self, event: ev.RoundChanged, now: ev.Now) -> Instructions:
        self._done(event)
        return self._observed(event.event, now)

    def _workers_changed(self, event: ev.WorkersChanged, now: ev.Now) -> Instructions:
        """A worker changed: publish it; in a running round, workers that ended are news."""
        self.group, self.failures = event.group, event.failures
        if self.place is not None:
            self.place.sync(self.group)
        out: Instructions = []
        if self.reported is not None and self.phase is not Phase.CLOSING:
            out += self._report(self.report_state, now, self.info, self.group)
        if self.phase is Phase.RUNNING:
            result = (
                inplace.round_result(self)
                if self.in_place
                else run_result(self.group, self.failures)
            )
            if result is not None:
                out += self._exited(result, now)
        elif self.phase is Phase.WARMING:
            out += inplace.warm_exited(self, now)
        return out

    def _exited(self, result: RunResult, now: ev.Now) -> Instructions:
        """The workers ended: success is for the barrier; a failure may be a member's
        death, which is a membership change and spends no restart: ask its daemon first."""
        if result.state is WorkerState.SUCCEEDED:
            return self._drop("probe") + self._observed(WorkersExited(result), now)
        assert self.info is not None
        others = tuple(m.node for m in self.info.members if m.node != self.settings.node)
        if not others:
            return self._drop("probe") + self._observed(WorkersExited(result), now)
        self._to(Phase.PROBING)
        self.then = Then(seen=WorkersExited(result))
        return self._drop("watch", "probe") + [
            do.Probe(self.job, self._op("main"), others, self.settings.dead_after)
        ]

    def _probed(self, event: ev.PeersProbed, now: ev.Now) -> Instructions:
        self._done(event)
        seen = self.then.seen
        assert isinstance(seen, WorkersExited)
        self._to(Phase.RUNNING)
        return self._observed(WorkersExited(seen.result, event.lost), now)

    def _act(self, decision: Decision, seen: Observed, now: ev.Now) -> Instructions:
        """Carry out a decision: every one but WATCH stops the round's watch; those that
        leave the round stop the workers first (in place: only when the workers must go)."""
        assert self.info is not None and decision is not Decision.WATCH
        out = self._drop("watch", "probe")
        if isinstance(seen, WorkersExited) and self.group is not None:
            out += [
                do.Count("worker_exited", "", w.exit_code)
                for w in self.group.workers
                if w.exit_code is not None
            ]
        if self.in_place:
            handled = inplace.act(self, decision, seen, now)
            if handled is not None:
                return out + handled
        if decision in (Decision.RESTART, Decision.NODE_LOST, Decision.SCALE_UP, Decision.REJOIN):
            out += self._report(PartState.RESTARTING, now, self.info, self.group)
        return out + self._stop_then(Then(decision=decision, seen=seen))

    def _stop_then(self, then: Then) -> Instructions:
        self._to(Phase.STOPPING)
        self.then = then
        return [do.StopWorkers(self.job, self._op("main"))]

    def _stopped(self, event: ev.WorkersStopped, now: ev.Now) -> Instructions:
        self._done(event)
        then, info, group = self.then, self.info, self.group
        assert info is not None and then.decision is not None
        if then.new_pool:
            return inplace.fresh_pool(self, now) + self._request(
                then.reason or Reason.STALLED, then.seen, now
            )
        decision = then.decision
        if decision in ROUND_FOR:
            lost = then.seen.lost if isinstance(then.seen, WorkersExited) else ()
            return self._request(ROUND_FOR[decision], then.seen, now, lost)
        if decision is Decision.REJOIN:
            return self._rejoin(now)
        if decision is Decision.FAIL:
            assert isinstance(then.seen, WorkersExited)
            outcome = failure_outcome(then.seen.result, self.spec, now.wall, self.settings.node)
            return self._finish(outcome, PartState.FAILED, now, info, group)
        if decision is Decision.BARRIER:
            return self._barrier(now)
        if decision is Decision.LEAVE:
            return self._leave(now, info, group)
        return self._end(PartState.STOPPED, now, info, group)

    def _request(
        self,
        reason: Reason,
        seen: Observed | None,
        now: ev.Now,
        lost: tuple[str, ...] = (),
        current: bool = False,
    ) -> Instructions:
        """The round after this part's own (``current``: after the current one, for a part outside it)."""
        self._to(Phase.REQUESTING)
        self.then = Then(seen=seen, reason=reason)
        round = None if current or self.info is None else self.info.round
        return [do.RequestRound(self.job, self._op("main"), round, reason, lost)]

    def _requested(self, event: ev.RoundRequested, now: ev.Now) -> Instructions:
        self._done(event)
        if event.result is NextRound.EXHAUSTED:
            return self._finish(
                self._exhausted(self.then.seen, now), PartState.FAILED, now, self.info
            )
        if event.result is NextRound.CLOSED:
            return self._end(PartState.STOPPED, now, self.info)
        out: Instructions = []
        if event.result is NextRound.OPENED:
            out.append(
                do.Say(
                    "info",
                    "rendezvous %s: %s opened a new round (%s)",
                    self.job,
                    (self.job, self.settings.node, self.then.reason),
                )
            )
        if self.then.reason in CHARGED:
            out.append(do.Count("restarted"))
        return out + self._rejoin(now)

    def _exhausted(self, seen: Observed | None, now: ev.Now) -> Outcome:
        if isinstance(seen, WorkersExited):
            return failure_outcome(seen.result, self.spec, now.wall, self.settings.node)
        slots = seen.slots if isinstance(seen, RejoinStalled) else ()
        return Outcome(
            JobState.FAILED,
            now.wall,
            1,
            f"workers in slots {list(slots)} on {self.settings.node} did not rejoin within "
            f"{self.spec.rejoin_timeout:g} s (max restarts {self.spec.max_restarts} exhausted)",
            None,
            self.settings.node,
        )

    def _rejoin(self, now: ev.Now) -> Instructions:
        """On to the next round."""
        if (
            self.in_place
        ):  # a part still in its rendezvous (its warm-up failed) warms again as it is
            out = (
                self._report(PartState.RESTARTING, now, self.info, self.group) if self.info else []
            )
            return out + inplace.rejoin(self, now)
        return self._report(PartState.RESTARTING, now, self.info) + self._join(now)

    # -- the exit barrier -------------------------------------------------------------------------

    def _barrier(self, now: ev.Now) -> Instructions:
        """Wait for every member of the final round; the job succeeds only if all arrive.
        A new round (a failure elsewhere) sends this node back to work."""
        assert self.info is not None
        self._to(Phase.BARRIER)
        self.since = now.mono
        self.barrier_deadline = now.wall + self.spec.exit_barrier_timeout
        if self.leaving is not None:
            return self._leave(now, self.info, self.group)
        return [
            do.ArriveAtBarrier(
                self.job, self._op("main"), self.info, self.spec.exit_barrier_timeout
            ),
            do.Watch(self.job, self._op("watch"), self.info.round, False),
        ]

    def _barrier_progress(self, event: ev.BarrierProgress, now: ev.Now) -> Instructions:
        return self._report(
            PartState.BARRIER,
            now,
            self.info,
            self.group,
            barrier={"done": event.done, "total": event.total, "deadline": self.barrier_deadline},
        )

    def _barrier_done(self, event: ev.BarrierDone, now: ev.Now) -> Instructions:
        self._done(event)
        out = self._drop("watch") + [do.Count("barrier_waited", "", now.mono - self.since)]
        if event.arrived >= event.total:
            outcome = Outcome(JobState.SUCCEEDED, now.wall, 0, "", None, self.settings.node)
            return out + self._finish(outcome, PartState.SUCCEEDED, now, self.info, self.group)
        outcome = Outcome(
            JobState.FAILED,
            now.wall,
            None,
            f"exit barrier timed out after {self.spec.exit_barrier_timeout:g} s: "
            f"{event.arrived}/{event.total} nodes finished",
            None,
            self.settings.node,
        )
        return out + self._finish(outcome, PartState.FAILED, now, self.info, self.group)

    def _barrier_round(self, event: ev.RoundChanged, now: ev.Now) -> Instructions:
        self._done(event)
        if event.event.kind is EventKind.NEXT_ROUND:
            return self._drop() + self._rejoin(now)
        return []  # closed: the job's outcome is on its way (job_ended)

    def _barrier_ended(self, now: ev.Now) -> Instructions:
        """The job ended while this node waited: every member arrived if it succeeded."""
        assert self.ended is not None
        out = self._drop() + [do.Count("barrier_waited", "", now.mono - self.since)]
        state = PartState.SUCCEEDED if self.ended.state is JobState.SUCCEEDED else PartState.STOPPED
        return out + self._end(state, now, self.info, self.group)

    # -- finishing, leaving, failing -------------------------------------------------------------

    def _finish(
        self,
        outcome: Outcome,
        state: PartState,
        now: ev.Now,
        info: RendezvousInfo | None = None,
        group: WorkerGroup | None = None,
        on_store_failure: PartState = PartState.LEFT,
    ) -> Instructions:
        self._to(Phase.FINISHING)
        self.then = Then(state=state, on_store_failure=on_store_failure)
        self.finish_with = (info, group)
        return [do.Finish(self.job, self._op("main"), outcome)]

    def _finished(self, event: ev.Finished, now: ev.Now) -> Instructions:
        self._done(event)
        self.ended = self.ended or event.outcome
        info, group = self.finish_with
        assert self.then.state is not None
        return self._end(self.then.state, now, info, group)

    def _leave(
        self, now: ev.Now, info: RendezvousInfo | None, group: WorkerGroup | None
    ) -> Instructions:
        assert self.leaving is not None
        self._to(Phase.LEAVING)
        self.finish_with = (info, group)
        return self._drop() + [do.Leave(self.job, self._op("main"), self.leaving)]

    def _left(self, event: ev.Left | ev.OpFailed, now: ev.Now) -> Instructions:
        self._done(event)
        out: Instructions = []
        if isinstance(event, ev.OpFailed):
            out.append(
                do.Say(
                    "warning",
                    "job %s: could not tell the rendezvous that %s leaves: %s",
                    self.job,
                    (self.job, self.settings.node, event.message),
                )
            )
        info, group = self.finish_with
        return out + self._end(PartState.LEFT, now, info, group)

    def _op_failed(self, event: ev.OpFailed, now: ev.Now) -> Instructions:
        """The store did not answer: this node's share ends here (the others re-form without
        it, and it may join again once the store answers; the job's fate is not its to
        write).  Anything else is a bug: the job fails, saying so."""
        self._done(event)
        if event.store:
            self.declined = event.message
            return [
                do.Say(
                    "warning",
                    "job %s: leaving, the store does not answer: %s",
                    self.job,
                    (self.job, event.message),
                )
            ] + self._end(PartState.LEFT, now)
        outcome = Outcome(
            JobState.FAILED,
            now.wall,
            None,
            f"elasticd agent on {self.settings.node} failed",
            None,
            self.settings.node,
        )
        return (
            [do.Say("error", "agent for job %s failed: %s", self.job, (self.job, event.message))]
            + self._drop()
            + self._finish(outcome, PartState.FAILED, now, on_store_failure=PartState.FAILED)
        )

    def _finish_failed(self, event: ev.OpFailed, now: ev.Now) -> Instructions:
        self._done(event)
        if event.store and self.then.on_store_failure is PartState.FAILED:
            return [
                do.Say(
                    "warning",
                    "job %s: could not record that its agent failed: %s",
                    self.job,
                    (self.job, event.message),
                )
            ] + self._end(PartState.FAILED, now)
        return self._op_failed(event, now) if event.store else self._end(PartState.FAILED, now)


class _Ignore:
    def __repr__(self) -> str:
        return "IGNORE"


IGNORE: Any = _Ignore()  # an event a phase takes and does nothing about
P = PartCore


_WORKERS = {ev.WorkersChanged: P._workers_changed}
_ASIDE = {ev.WorkerAsked: inplace.noted_asked, ev.TimerFired: IGNORE}  # in place, between rounds
PART_EVENTS = EventTable(
    "a part",
    {
        Phase.STARTING: {},
        Phase.WARMING: {
            **_WORKERS,
            ev.WorkerAsked: inplace.warm_asked,
            ev.TimerFired: IGNORE,
            ev.OpFailed: P._op_failed,
        },
        Phase.JOINING: {
            ev.RoundJoined: P._joined,
            ev.JoinFailed: P._join_failed,
            **_WORKERS,
            **_ASIDE,
            ev.OpFailed: P._op_failed,
        },
        Phase.RUNNING: {
            ev.RoundChanged: P._round_changed,
            **_WORKERS,
            ev.WorkerAsked: inplace.running_asked,
            ev.TimerFired: inplace.timer,
            ev.PeersProbed: inplace.running_probed,
            ev.OpFailed: P._op_failed,
        },
        Phase.PROBING: {ev.PeersProbed: P._probed, **_WORKERS, **_ASIDE, ev.OpFailed: P._op_failed},
        Phase.STOPPING: {
            ev.WorkersStopped: P._stopped,
            **_WORKERS,
            **_ASIDE,
            ev.OpFailed: P._op_failed,
        },
        Phase.REQUESTING: {
            ev.RoundRequested: P._requested,
            **_WORKERS,
            **_ASIDE,
            ev.OpFailed: P._op_failed,
        },
        Phase.BARRIER: {
            ev.BarrierProgress: P._barrier_progress,
            ev.BarrierDone: P._barrier_done,
            ev.RoundChanged: P._barrier_round,
            **_WORKERS,
            **_ASIDE,
            ev.OpFailed: P._op_failed,
        },
        Phase.FINISHING: {
            ev.Finished: P._finished,
            **_WORKERS,
            **_ASIDE,
            ev.OpFailed: P._finish_failed,
        },
        Phase.LEAVING: {ev.Left: P._left, ev.OpFailed: P._left, **_WORKERS, **_ASIDE},
        Phase.CLOSING: {
            ev.WorkersChanged: IGNORE,
            ev.WorkerAsked: IGNORE,
            ev.TimerFired: IGNORE,
            ev.OpFailed: IGNORE,
        },
    },
)


def _keep(part: PartCore, now: ev.Now) -> Instructions:
    return []  # heard; acted on where the part next looks (a join, a watch)


def _stop_joining(part: PartCore, now: ev.Now) -> Instructions:
    return part._drop() + part._end(PartState.STOPPED, now)


def _stop_running(part: PartCore, now: ev.Now) -> Instructions:
    assert part.ended is not None
    return part._observed(JobEnded(part.ended), now)


def _stop_warming(part: PartCore, now: ev.Now) -> Instructions:
    return part._drop() + part._end(PartState.STOPPED, now)


ENDED_IN: dict[Phase, Callable[[PartCore, ev.Now], Instructions]] = {
    Phase.STARTING: _keep,
    Phase.WARMING: _stop_warming,
    Phase.JOINING: _stop_joining,
    Phase.RUNNING: _stop_running,
    Phase.PROBING: _keep,
    Phase.STOPPING: _keep,
    Phase.REQUESTING: _keep,
    Phase.BARRIER: PartCore._barrier_ended,
    Phase.FINISHING: _keep,
    Phase.LEAVING: _keep,
    Phase.CLOSING: _keep,
}


def _leave_joining(part: PartCore, now: ev.Now) -> Instructions:
    return part._leave(now, None, None)


def _leave_warming(part: PartCore, now: ev.Now) -> Instructions:
    return part._leave(now, None, part.group)


def _leave_running(part: PartCore, now: ev.Now) -> Instructions:
    assert part.leaving is not None
    return part._observed(Leaving(part.leaving), now)


def _leave_barrier(part: PartCore, now: ev.Now) -> Instructions:
    return part._leave(now, part.info, part.group)


LEAVE_IN: dict[Phase, Callable[[PartCore, ev.Now], Instructions]] = {
    Phase.STARTING: _keep,
    Phase.WARMING: _leave_warming,
    Phase.JOINING: _leave_joining,
    Phase.RUNNING: _leave_running,
    Phase.PROBING: _keep,
    Phase.STOPPING: _keep,
    Phase.REQUESTING: _keep,
    Phase.BARRIER: _leave_barrier,
    Phase.FINISHING: _keep,
    Phase.LEAVING: _keep,
    Phase.CLOSING: _keep,
}
