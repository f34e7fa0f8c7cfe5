"""One node's share of one job (a *part*): torchelastic's SimpleElasticAgent as a state
machine, with three fixes (docs/architecture.md, "The node core").

    join -> start workers -> watch -> (restart | re-form | scale up | exit barrier) -> end

1. A worker failure anywhere opens a new round of the job's rendezvous, so every node
   stops its workers and re-forms at once; nobody hangs in a collective.
2. The restart budget is job-wide: it lives in the rendezvous state.
3. A dead node is seen by heartbeat (or found gone when workers fail); the survivors
   re-form within seconds, and no restart is spent on it.

An in-place job (``--in-place``) is a policy of the same machine (inplace.py): the survivors
keep their processes across rounds, missing workers warm up before their node offers them to
a round.  The policy drives the part through its public methods only (port.py names them).

Pure: ``handle(event, now)`` changes the part and returns instructions; nothing here waits,
reads a clock or touches a process.  What each phase does with each kind of event is one
table, PART_EVENTS; an event a phase does not list raises IllegalTransition and changes
nothing, as does a move PART_PHASES lacks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from elasticd.core import events as ev
from elasticd.core import hang
from elasticd.core import instructions as do
from elasticd.core.checkpoints import newest
from elasticd.core.model import (
    PART_STATES,
    Failure,
    JobSpec,
    JobState,
    PartState,
    RunResult,
    WorkerGroup,
    WorkerState,
    assign_workers,
    master_ports,
)
from elasticd.core.part import inplace, spares
from elasticd.core.part.phases import PART_PHASES, Phase
from elasticd.core.part.pool import Pool
from elasticd.core.policy import (
    ROUND_FOR,
    Decision,
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
from elasticd.core.tables import EventTable, IllegalTransition
from elasticd.rendezvous import CHARGED, EventKind, NextRound, Reason, RendezvousInfo

Instructions = list[do.Instruction]


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
class PartSettings:
    """What the part needs of its node."""

    node: str
    dead_after: float  # seconds after which a silent member counts as dead


@dataclass
class PartCore:
    """One job on this node.  Its fields are the part's whole state."""

    spec: JobSpec
    nproc: int
    gpus: tuple[str, ...]
    settings: PartSettings
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
    # the nodes the cluster's schedule gives the job (none: no schedule)
    scheduled: frozenset[str] = frozenset()
    spares: int = 0  # in place: slots beyond ``nproc`` for warm spare workers
    then: Then = field(default_factory=Then)
    ops: dict[str, int] = field(default_factory=dict)  # what runs: "main", "watch", "probe" -> op
    next_op: int = 0
    since: float = 0.0  # when the running join or barrier wait began (monotonic)
    barrier_deadline: float = 0.0  # wall clock, shown
    story: Story = field(default_factory=Story)
    pool: Pool | None = None  # an in-place job's slots (None: a classic job)
    # the round and workers the part's last report shows, once it finishes or leaves
    finish_with: tuple[RendezvousInfo | None, WorkerGroup | None] = (None, None)
    going_to: Phase | None = None  # the phase the event being handled leads to, if one
    # this node's share of the job's newest checkpoints, as the checkpoint tier saw them
    checkpoints: tuple[Mapping[str, Any], ...] = ()
    # hung ranks (core/hang.py): each slot's last progress (monotonic), the hang timer's
    # name, how many checks found the round hung with no culprit here, and what they found
    progress: dict[int, float] = field(default_factory=dict)
    hang_timer: str | None = None
    hang_checks: int = 0
    hung: tuple[hang.HungRank, ...] = ()
    hang_cause: str = ""  # the last root cause of a hang found here (shown by status)

    # -- entry points ------------------------------------------------------------------------

    @property
    def job(self) -> str:
        return self.spec.id

    @property
    def in_place(self) -> bool:
        return self.pool is not None

    def start(self, now: ev.Now, stimulus_id: str = "") -> Instructions:
        """The part's first instructions (its effectors are made by StartPart before these)."""
        if self.pool is not None:
            out = inplace.begin(self, now)
        else:
            out = self.report(PartState.RENDEZVOUS, now) + self.join(now)
        return self.told(f"start [{stimulus_id}]", now, out)

    def handle(self, event: ev.PartEvent, now: ev.Now) -> Instructions:
        """The part's answer to one stimulus.  The table is looked up before anything
        changes, so an event the phase does not take changes nothing."""
        self.story.heard(now.mono, event)
        if not self._news(event):
            return []
        go = PART_EVENTS.lookup(self.phase, event)
        if isinstance(event, ev.JobEnded):
            self.ended = event.outcome
        elif isinstance(event, ev.Leaving):
            self.leaving = event.reason
        self.going_to = go.to
        try:
            out = go.handler(self, event, now) if go.handler is not None else []
        finally:
            self.going_to = None
        return self.told(f"{type(event).__name__} [{event.stimulus_id}]", now, out)

    def _news(self, event: ev.PartEvent) -> bool:
        """Whether ``event`` is news: not the completion of an operation given up on, not
        an end or a leaving heard before."""
        if isinstance(event, ev.JobEnded):
            return self.ended is None
        if isinstance(event, ev.Leaving):
            return self.leaving is None
        op = getattr(event, "op", None)
        return op is None or op in self.ops.values()

    # -- the port: what the in-place policy and the spares use (port.py) ------------------------

    def new_op(self, role: str) -> int:
        """Number a new operation (or timer) of ``role``; its completion carries it."""
        self.next_op += 1
        self.ops[role] = self.next_op
        return self.next_op

    def forget_op(self, role: str) -> None:
        self.ops.pop(role, None)

    def done(self, event: Any) -> None:
        """The operation that ``event`` completes is over."""
        self.ops = {role: op for role, op in self.ops.items() if op != event.op}

    def drop(self, *roles: str) -> Instructions:
        """Give up on what runs in ``roles`` (all of them when none is named)."""
        out: Instructions = []
        for role in roles or tuple(self.ops):
            op = self.ops.pop(role, None)
            if op is not None:
                out.append(do.Cancel(self.job, op))
        return out

    def move_to(self, phase: Phase) -> None:
        """Enter ``phase``: a move PART_PHASES lacks, or one the event's row in PART_EVENTS
        does not lead to, raises."""
        if self.going_to is not None and phase is not self.going_to:
            raise IllegalTransition(
                f"a part in {self.phase.value} was to go to {self.going_to.value}, not {phase.value}"
            )
        self.phase = PART_PHASES.check(self.phase, phase)

    def told(self, why: str, now: ev.Now, out: Instructions) -> Instructions:
        self.story.told(now.mono, why, out)
        return out

    def workers_run(self, now: ev.Now) -> Instructions:
        """Workers run here from ``now`` (warming up included): usage charges the part
        from the first time they do; the record says so at once."""
        if self.ran is not None or self.reported is None:
            return []
        self.ran = now.wall
        return self.report(self.report_state, now, self.info, self.group)

    def regroup(self, group: WorkerGroup) -> None:
        """The workers are now ``group`` (in place: a new pool, or new workers in it)."""
        self.group = group

    def give_back_spares(self, n: int) -> None:
        """``n`` spares' slots go back to the node for good."""
        self.spares -= n

    def report(
        self,
        state: PartState,
        now: ev.Now,
        info: RendezvousInfo | None = None,
        group: WorkerGroup | None = None,
        barrier: dict[str, Any] | None = None,
    ) -> Instructions:
        """Publish this node's part in ``state`` (PART_STATES)."""
        self.report_state = PART_STATES.check(self.reported, state)
        self.reported = state
        self.ran = now.wall if self.ran is None and state is PartState.RUNNING else self.ran
        part = Part(
            node=self.settings.node,
            state=state,
            started=self.started,
            barrier=barrier,
            workers=tuple(w.to_json() for w in group.workers) if group else (),
            updated=now.wall,
            held=self.held,
            ran=self.ran,
            slots=self.nproc + self.spares,
            gpus=len(self.gpus) - len(spares.given_gpus(self)),
            spares=len(self.pool.parked()) if self.pool is not None else 0,
            checkpoints=tuple(dict(m) for m in self.checkpoints),
            hung=self.hang_cause,
        )
        if info:
            part = replace(
                part,
                round=info.round,
                group_rank=info.group_rank,
                restarts=info.restart_count,
                world_size=info.world_size,
                group_world_size=info.group_world_size,
            )
        return [do.Publish(self.job, part)]

    def end(
        self,
        state: PartState,
        now: ev.Now,
        info: RendezvousInfo | None = None,
        group: WorkerGroup | None = None,
    ) -> Instructions:
        """Publish the part's last state and close it."""
        out = self.report(state, now, info, group)
        self.move_to(Phase.CLOSING)
        return out + self.drop() + [do.ClosePart(self.job)]

    def join(self, now: ev.Now, nproc: int | None = None) -> Instructions:
        """Join the next round; the job's end or this node's leaving comes first."""
        if self.ended is not None:
            return self.end(PartState.STOPPED, now)
        if self.leaving is not None:
            return self.depart(now, None, None)
        self.move_to(Phase.JOINING)
        self.since = now.mono
        return [
            do.Join(
                self.job,
                self.new_op("main"),
                self.nproc if nproc is None else nproc,
                master_ports(self.spec),
                tuple(sorted(self.scheduled)),
            )
        ]

    def enter_round(self, info: RendezvousInfo, group: WorkerGroup, now: ev.Now) -> Instructions:
        """This node's workers are ``group`` in the round ``info``: publish it running."""
        self.info, self.group = info, group
        self.started = self.started or now.wall
        self.progress, self.hang_checks, self.hung = {}, 0, ()
        return self.report(PartState.RUNNING, now, info, group)

    def watch(self, now: ev.Now, notice_waiting: bool | None = None) -> Instructions:
        """Watch the round; the job's end or this node's leaving, heard already, first."""
        assert self.info is not None
        if notice_waiting is not None:
            self.notice_waiting = notice_waiting
        self.move_to(Phase.RUNNING)
        if self.ended is not None:
            return self.observe(ev.JobEnded(self.job, self.ended), now)
        if self.leaving is not None:
            return self.observe(ev.Leaving(self.job, self.leaving), now)
        return [do.Watch(self.job, self.new_op("watch"), self.info.round, self.notice_waiting)]

    def observe(self, seen: Observed, now: ev.Now) -> Instructions:
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
            return [say, *self.watch(now, notice_waiting=False)]
        return [say, *self._act(decision, seen, now)]

    def stop_then(
        self,
        decision: Decision,
        seen: Observed,
        reason: Reason | None = None,
        new_pool: bool = False,
    ) -> Instructions:
        """Stop the workers; then carry out ``decision`` (``_stopped``)."""
        self.move_to(Phase.STOPPING)
        self.then = Then(decision=decision, seen=seen, reason=reason, new_pool=new_pool)
        return [do.StopWorkers(self.job, self.new_op("main"))]

    def request(
        self,
        reason: Reason,
        seen: Observed | None,
        now: ev.Now,
        lost: tuple[str, ...] = (),
        current: bool = False,
    ) -> Instructions:
        """Ask for the round after this part's own (``current``: after whichever round is
        current, for a part outside it, e.g. warming up)."""
        assert current or self.info is not None
        self.move_to(Phase.REQUESTING)
        self.then = Then(seen=seen, reason=reason)
        round = None if current or self.info is None else self.info.round
        return [do.RequestRound(self.job, self.new_op("main"), round, reason, lost)]

    def rejoin(self, now: ev.Now) -> Instructions:
        """On to the next round."""
        if self.pool is not None:
            # a part still in its rendezvous (its warm-up failed) warms again as it is
            out = (
                []
                if self.reported is PartState.RENDEZVOUS
                else self.report(PartState.RESTARTING, now, self.info, self.group)
            )
            return out + inplace.next_round(self, self.info, now)
        return self.report(PartState.RESTARTING, now, self.info) + self.join(now)

    def finish(
        self,
        outcome: Outcome,
        state: PartState,
        now: ev.Now,
        info: RendezvousInfo | None = None,
        group: WorkerGroup | None = None,
        on_store_failure: PartState = PartState.LEFT,
    ) -> Instructions:
        """Write the job's outcome (the first writer wins), then end in ``state``."""
        self.move_to(Phase.FINISHING)
        self.then = Then(state=state, on_store_failure=on_store_failure)
        self.finish_with = (info, group)
        return [do.Finish(self.job, self.new_op("main"), outcome)]

    def depart(
        self, now: ev.Now, info: RendezvousInfo | None, group: WorkerGroup | None
    ) -> Instructions:
        """Tell the rendezvous that this node leaves the job, then end."""
        assert self.leaving is not None
        self.move_to(Phase.LEAVING)
        self.finish_with = (info, group)
        return self.drop() + [do.Leave(self.job, self.new_op("main"), self.leaving)]

    # -- joining ---------------------------------------------------------------------------------

    def _joined(self, event: ev.RoundJoined, now: ev.Now) -> Instructions:
        self.done(event)
        info = event.info
        out: Instructions = [do.Count("round_joined", info.reason.value, now.mono - self.since)]
        if self.pool is not None:
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
        self.failures = ()
        if self.started is None:  # the job's first start: there is nothing to restore
            return out + self._start(info, group, now)
        self.info, self.group = info, group
        self.move_to(Phase.PREPARING)
        members = tuple(m.node for m in info.members)
        agreed = newest(m.holds for m in info.members)
        return out + [do.PrepareRestore(self.job, self.new_op("main"), info.round, members, agreed)]

    def _start(self, info: RendezvousInfo, group: WorkerGroup, now: ev.Now) -> Instructions:
        out = self.enter_round(info, group, now)
        out.append(do.StartWorkers(self.job, group, info.round))
        return out + self.watch(now, notice_waiting=True)

    def _restore_prepared(self, event: ev.RestorePrepared, now: ev.Now) -> Instructions:
        """The checkpoint is in place: the workers start.  None can be (the newest complete
        one and its copy are gone, and not on disk): the job fails, saying which and why."""
        self.done(event)
        assert self.info is not None and self.group is not None
        if not event.failure:
            return self._start(self.info, self.group, now)
        outcome = Outcome(JobState.FAILED, now.wall, None, event.failure, None, self.settings.node)
        return self.finish(outcome, PartState.FAILED, now, self.info)

    def _checkpoints_changed(self, event: ev.CheckpointsChanged, now: ev.Now) -> Instructions:
        """The checkpoint tier's news travels in this node's part record."""
        self.checkpoints = event.manifests
        if self.reported is None:
            return []
        return self.report(self.report_state, now, self.info, self.group)

    def _join_failed(self, event: ev.JoinFailed, now: ev.Now) -> Instructions:
        self.done(event)
        if event.kind == ev.JoinFailure.CLOSED:
            return self.end(PartState.STOPPED, now)
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
                *self.end(PartState.LEFT, now),
            ]
        outcome = Outcome(JobState.FAILED, now.wall, None, event.message, None, self.settings.node)
        return self.finish(outcome, PartState.FAILED, now)

    # -- a round ---------------------------------------------------------------------------------

    def _round_changed(self, event: ev.RoundChanged, now: ev.Now) -> Instructions:
        self.done(event)
        return self.observe(event.event, now)

    def _workers_changed(self, event: ev.WorkersChanged, now: ev.Now) -> Instructions:
        """A worker changed: publish it; in a running round, workers that ended are news."""
        self.group, self.failures = event.group, event.failures
        if self.pool is not None:
            self.pool.sync(self.group)
        out: Instructions = []
        if self.reported is not None and self.phase is not Phase.CLOSING:
            out += self.report(self.report_state, now, self.info, self.group)
        if self.phase is Phase.RUNNING:
            result = (
                inplace.round_result(self)
                if self.pool is not None
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
            return self.drop("probe") + self.observe(WorkersExited(result), now)
        assert self.info is not None
        seen = WorkersExited(
            result, carried=self.pool is not None and inplace.died_before_its_place(self, result)
        )
        others = tuple(m.node for m in self.info.members if m.node != self.settings.node)
        if not others:
            return self.drop("probe") + self.observe(seen, now)
        self.move_to(Phase.PROBING)
        self.then = Then(seen=seen)
        return self.drop("watch", "probe") + [
            do.Probe(self.job, self.new_op("main"), others, self.settings.dead_after)
        ]

    def _probed(self, event: ev.PeersProbed, now: ev.Now) -> Instructions:
        self.done(event)
        seen = self.then.seen
        assert isinstance(seen, WorkersExited)
        self.move_to(Phase.RUNNING)
        return self.observe(replace(seen, lost=event.lost), now)

    def _nodes_lost(self, event: ev.NodesLost, now: ev.Now) -> Instructions:
        """Members of this part's round are gone: the survivors re-form at once."""
        assert self.info is not None
        members = {m.node for m in self.info.members}
        lost = tuple(n for n in event.nodes if n != self.settings.node and n in members)
        if not lost:
            return []
        seen = WorkersExited(RunResult(WorkerState.FAILED, ()), lost)
        say = do.Say(
            "info",
            "job %s round %d: node %s is gone -> %s",
            self.job,
            (self.job, self.info.round, ", ".join(lost), Decision.NODE_LOST.value),
        )
        return [say, *self._act(Decision.NODE_LOST, seen, now)]

    # -- hung ranks (core/hang.py) -----------------------------------------------------------

    def _placed_slots(self) -> tuple[int, ...]:
        group = self.group
        if group is None:
            return ()
        return tuple(
            w.local_rank
            for w in group.workers
            if w.rank >= 0 and w.state in (WorkerState.HEALTHY, WorkerState.INIT)
        )

    def _progressed(self, event: ev.Progressed, now: ev.Now) -> Instructions:
        """A worker made progress: the round is not hung; watch it from here on."""
        self.progress[event.slot] = now.mono
        self.hang_checks, self.hung = 0, ()
        if self.phase is not Phase.RUNNING or not self.spec.hang_timeout or self.hang_timer:
            return []
        return self._arm_hang(now.mono + self.spec.hang_timeout)

    def _arm_hang(self, at: float) -> Instructions:
        self.hang_timer = f"hang/{self.new_op('timer-hang')}"
        return [do.SetTimer(self.hang_timer, at, job=self.job)]

    def _timer(self, event: ev.TimerFired, now: ev.Now) -> Instructions:
        if event.name == self.hang_timer:
            self.hang_timer = None
            self.forget_op("timer-hang")
            return self._hang_check(now)
        return inplace.timer(self, event, now) if self.pool is not None else []

    def _timer_aside(self, event: ev.TimerFired, now: ev.Now) -> Instructions:
        if event.name == self.hang_timer:  # out of a running round: checked once back in one
            self.hang_timer = None
            self.forget_op("timer-hang")
            return []
        return inplace.timer_aside(self, event, now)

    def _hang_check(self, now: ev.Now) -> Instructions:
        """No progress from any placed worker for the hang timeout: dump their stacks (once);
        on a second such check, with no culprit found anywhere, fail them."""
        timeout = self.spec.hang_timeout
        slots = hang.hung_slots(self.progress, self._placed_slots(), timeout, now.mono)
        if not slots:
            at = hang.next_check(self.progress, self._placed_slots(), timeout)
            return self._arm_hang(max(at, now.mono + 0.1)) if at is not None else []
        if self.hang_checks and self.hung:
            self.hang_checks = 0
            return self._fail_hung(self.hung, hang.waited_cause, now)
        if "dump" in self.ops:
            return []
        why = f"no progress for {timeout:g} s"
        return [
            do.Say(
                "warning",
                "job %s round %d: ranks %s on %s made %s: dumping their stacks into the job's logs",
                self.job,
                (
                    self.job,
                    self.info.round if self.info else -1,
                    self._ranks(slots),
                    self.settings.node,
                    why,
                ),
            ),
            do.DumpStacks(self.job, self.new_op("dump"), slots, why),
        ]

    def _ranks(self, slots: tuple[int, ...]) -> list[int]:
        ranks = {w.local_rank: w.rank for w in self.group.workers} if self.group else {}
        return [ranks.get(s, -1) for s in slots]

    def _ranks_hung(self, event: ev.RanksHung, now: ev.Now) -> Instructions:
        """The stacks are in the logs: fail the ranks that are not inside a collective (the
        root cause); with none here, wait one more timeout for the culprit's node."""
        self.done(event)
        ranks = tuple(event.ranks)
        guilty = hang.culprits(ranks)
        if guilty:
            self.hang_checks, self.hung = 0, ()
            return self._fail_hung(guilty, hang.cause, now)
        self.hang_checks, self.hung = self.hang_checks + 1, ranks
        out = [
            do.Say(
                "warning",
                "job %s: its ranks %s on %s wait in a collective: the rank they wait for is "
                "elsewhere (its node fails it), else they fail in %g s",
                self.job,
                (self.job, [r.rank for r in ranks], self.settings.node, self.spec.hang_timeout),
            )
        ]
        return out + self._arm_hang(now.mono + self.spec.hang_timeout)

    def _ranks_hung_aside(self, event: ev.RanksHung, now: ev.Now) -> Instructions:
        self.done(event)
        return []

    def _fail_hung(
        self, ranks: tuple[hang.HungRank, ...], why: Callable[..., str], now: ev.Now
    ) -> Instructions:
        out: Instructions = []
        for rank in ranks:
            cause = why(rank, self.settings.node, self.spec.hang_timeout)
            self.hang_cause = cause
            out += [
                do.Say("error", "job %s: %s", self.job, (self.job, cause)),
                do.FailSlots(self.job, (rank.slot,), cause),
            ]
        return out + self.report(self.report_state, now, self.info, self.group)

    def _act(self, decision: Decision, seen: Observed, now: ev.Now) -> Instructions:
        """Carry out a decision: every one but WATCH stops the round's watch; those that
        leave the round stop the workers first (in place: only when the workers must go)."""
        assert self.info is not None and decision is not Decision.WATCH
        out = self.drop("watch", "probe")
        if isinstance(seen, WorkersExited) and self.group is not None:
            out += [
                do.Count("worker_exited", "", w.exit_code)
                for w in self.group.workers
                if w.exit_code is not None
            ]
        if self.pool is not None:
            handled = inplace.act(self, decision, seen, now)
            if handled is not None:
                return out + handled
        if decision in (Decision.RESTART, Decision.NODE_LOST, Decision.SCALE_UP, Decision.REJOIN):
            out += self.report(PartState.RESTARTING, now, self.info, self.group)
        return out + self.stop_then(decision, seen)

    def _stopped(self, event: ev.WorkersStopped, now: ev.Now) -> Instructions:
        self.done(event)
        then, info, group = self.then, self.info, self.group
        assert info is not None and then.decision is not None
        if then.new_pool:
            return inplace.fresh_pool(self, now) + self.request(
                then.reason or Reason.STALLED, then.seen, now
            )
        decision = then.decision
        if decision in ROUND_FOR:
            lost = then.seen.lost if isinstance(then.seen, WorkersExited) else ()
            return self.request(ROUND_FOR[decision], then.seen, now, lost)
        if decision is Decision.REJOIN:
            return self.rejoin(now)
        if decision is Decision.FAIL:
            assert isinstance(then.seen, WorkersExited)
            outcome = failure_outcome(then.seen.result, self.spec, now.wall, self.settings.node)
            return self.finish(outcome, PartState.FAILED, now, info, group)
        if decision is Decision.BARRIER:
            return self._barrier(now)
        if decision is Decision.LEAVE:
            return self.depart(now, info, group)
        return self.end(PartState.STOPPED, now, info, group)

    def _requested(self, event: ev.RoundRequested, now: ev.Now) -> Instructions:
        self.done(event)
        if event.result is NextRound.EXHAUSTED:
            return self.finish(
                self._exhausted(self.then.seen, now), PartState.FAILED, now, self.info
            )
        if event.result is NextRound.CLOSED:
            return self.end(PartState.STOPPED, now, self.info)
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
        return out + self.rejoin(now)

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

    # -- the exit barrier -------------------------------------------------------------------------

    def _barrier(self, now: ev.Now) -> Instructions:
        """Wait for every member of the final round; the job succeeds only if all arrive.
        A new round (a failure elsewhere) sends this node back to work."""
        assert self.info is not None
        self.move_to(Phase.BARRIER)
        self.since = now.mono
        self.barrier_deadline = now.wall + self.spec.exit_barrier_timeout
        if self.leaving is not None:
            return self.depart(now, self.info, self.group)
        return [
            do.ArriveAtBarrier(
                self.job, self.new_op("main"), self.info, self.spec.exit_barrier_timeout
            ),
            do.Watch(self.job, self.new_op("watch"), self.info.round, False),
        ]

    def _barrier_progress(self, event: ev.BarrierProgress, now: ev.Now) -> Instructions:
        return self.report(
            PartState.BARRIER,
            now,
            self.info,
            self.group,
            barrier={"done": event.done, "total": event.total, "deadline": self.barrier_deadline},
        )

    def _barrier_done(self, event: ev.BarrierDone, now: ev.Now) -> Instructions:
        self.done(event)
        out = self.drop("watch") + [do.Count("barrier_waited", "", now.mono - self.since)]
        if event.arrived >= event.total:
            outcome = Outcome(JobState.SUCCEEDED, now.wall, 0, "", None, self.settings.node)
            return out + self.finish(outcome, PartState.SUCCEEDED, now, self.info, self.group)
        outcome = Outcome(
            JobState.FAILED,
            now.wall,
            None,
            f"exit barrier timed out after {self.spec.exit_barrier_timeout:g} s: "
            f"{event.arrived}/{event.total} nodes finished",
            None,
            self.settings.node,
        )
        return out + self.finish(outcome, PartState.FAILED, now, self.info, self.group)

    def _barrier_round(self, event: ev.RoundChanged, now: ev.Now) -> Instructions:
        self.done(event)
        if event.event.kind is EventKind.NEXT_ROUND:
            return self.drop() + self.rejoin(now)
        return []  # closed: the job's outcome is on its way (JobEnded)

    # -- the job ended, this node leaves ----------------------------------------------------------

    def _ended_then_stop(self, event: ev.JobEnded, now: ev.Now) -> Instructions:
        """The job ended before this node's workers ran a round."""
        return self.drop() + self.end(PartState.STOPPED, now)

    def _ended_at_barrier(self, event: ev.JobEnded, now: ev.Now) -> Instructions:
        """The job ended while this node waited: every member arrived if it succeeded."""
        out = self.drop() + [do.Count("barrier_waited", "", now.mono - self.since)]
        state = (
            PartState.SUCCEEDED if event.outcome.state is JobState.SUCCEEDED else PartState.STOPPED
        )
        return out + self.end(state, now, self.info, self.group)

    def _observe_it(self, event: ev.JobEnded | ev.Leaving, now: ev.Now) -> Instructions:
        """In a running round the job's end and this node's leaving are news of the round."""
        return self.observe(event, now)

    def _leave_now(self, event: ev.Leaving, now: ev.Now) -> Instructions:
        """Leave at once: a part outside a round (joining, warming) or at the barrier."""
        info = self.info if self.phase is Phase.BARRIER else None
        group = None if self.phase is Phase.JOINING else self.group
        return self.depart(now, info, group)

    # -- finishing, leaving, failing -------------------------------------------------------------

    def _finished(self, event: ev.Finished, now: ev.Now) -> Instructions:
        self.done(event)
        self.ended = self.ended or event.outcome
        info, group = self.finish_with
        assert self.then.state is not None
        return self.end(self.then.state, now, info, group)

    def _left(self, event: ev.Left | ev.OpFailed, now: ev.Now) -> Instructions:
        self.done(event)
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
        return out + self.end(PartState.LEFT, now, info, group)

    def _op_failed(self, event: ev.OpFailed, now: ev.Now) -> Instructions:
        """The store did not answer: this node's share ends here (the others re-form without
        it, and it may join again once the store answers; the job's fate is not its to
        write).  Anything else is a bug: the job fails, saying so."""
        self.done(event)
        if event.store:
            self.declined = event.message
            return [
                do.Say(
                    "warning",
                    "job %s: leaving, the store does not answer: %s",
                    self.job,
                    (self.job, event.message),
                ),
                *self.end(PartState.LEFT, now),
            ]
        outcome = Outcome(
            JobState.FAILED,
            now.wall,
            None,
            f"elasticd agent on {self.settings.node} failed",
            None,
            self.settings.node,
        )
        return [
            do.Say("error", "agent for job %s failed: %s", self.job, (self.job, event.message)),
            *self.drop(),
            *self.finish(outcome, PartState.FAILED, now, on_store_failure=PartState.FAILED),
        ]

    def _finish_failed(self, event: ev.OpFailed, now: ev.Now) -> Instructions:
        self.done(event)
        if event.store and self.then.on_store_failure is PartState.FAILED:
            return [
                do.Say(
                    "warning",
                    "job %s: could not record that its agent failed: %s",
                    self.job,
                    (self.job, event.message),
                ),
                *self.end(PartState.FAILED, now),
            ]
        return self._op_failed(event, now) if event.store else self.end(PartState.FAILED, now)


# -- the one table: what each phase does with each kind of event --------------------------------

Handler = Callable[[PartCore, Any, ev.Now], Instructions]


@dataclass(frozen=True)
class Go:
    """An event's row in a phase: its handler (None: heard, nothing done) and, where it is
    the only one, the phase it leads to (``PartCore.move_to`` holds the handler to it)."""

    handler: Handler | None
    to: Phase | None = None


HEARD = Go(None)  # taken, and nothing is done about it
NOTED = Go(None)  # JobEnded, Leaving: remembered; acted on where the part next joins or watches


def _rows(**common: Go) -> dict[type, Go]:
    return {getattr(ev, name): go for name, go in common.items()}


# What every phase but CLOSING takes the same way: workers' news is published; in place, a
# worker that asks between rounds is remembered; a timer of another phase is stale; a lost
# node matters only to a running round.
_AROUND = _rows(
    CheckpointsChanged=Go(PartCore._checkpoints_changed),
    WorkersChanged=Go(PartCore._workers_changed),
    WorkerAsked=Go(inplace.noted_asked),
    TimerFired=Go(PartCore._timer_aside),
    Progressed=Go(PartCore._progressed),
    RanksHung=Go(PartCore._ranks_hung_aside),
    NodesLost=HEARD,
    JobEnded=NOTED,
    Leaving=NOTED,
    OpFailed=Go(PartCore._op_failed),
)
_STOP_NOW = Go(PartCore._ended_then_stop, Phase.CLOSING)
_LEAVE_NOW = Go(PartCore._leave_now, Phase.LEAVING)

PART_EVENTS: EventTable[Phase, Go] = EventTable(
    "a part",
    {
        Phase.STARTING: _rows(
            NodesLost=HEARD,
            JobEnded=NOTED,
            Leaving=NOTED,
            CheckpointsChanged=Go(PartCore._checkpoints_changed),
        ),
        Phase.WARMING: {
            **_AROUND,
            ev.WorkerAsked: Go(inplace.warm_asked),
            ev.JobEnded: _STOP_NOW,
            ev.Leaving: _LEAVE_NOW,
        },
        Phase.JOINING: {
            **_AROUND,
            ev.RoundJoined: Go(PartCore._joined),
            ev.JoinFailed: Go(PartCore._join_failed),
            ev.JobEnded: _STOP_NOW,
            ev.Leaving: _LEAVE_NOW,
        },
        Phase.PREPARING: {**_AROUND, ev.RestorePrepared: Go(PartCore._restore_prepared)},
        Phase.RUNNING: {
            **_AROUND,
            ev.RoundChanged: Go(PartCore._round_changed),
            ev.WorkerAsked: Go(inplace.running_asked),
            ev.TimerFired: Go(PartCore._timer),
            ev.RanksHung: Go(PartCore._ranks_hung),
            ev.PeersProbed: Go(inplace.running_probed),
            ev.NodesLost: Go(PartCore._nodes_lost),
            ev.JobEnded: Go(PartCore._observe_it),
            ev.Leaving: Go(PartCore._observe_it),
        },
        Phase.PROBING: {**_AROUND, ev.PeersProbed: Go(PartCore._probed)},
        Phase.STOPPING: {**_AROUND, ev.WorkersStopped: Go(PartCore._stopped)},
        Phase.REQUESTING: {**_AROUND, ev.RoundRequested: Go(PartCore._requested)},
        Phase.BARRIER: {
            **_AROUND,
            ev.BarrierProgress: Go(PartCore._barrier_progress),
            ev.BarrierDone: Go(PartCore._barrier_done, Phase.FINISHING),
            ev.RoundChanged: Go(PartCore._barrier_round),
            ev.JobEnded: Go(PartCore._ended_at_barrier, Phase.CLOSING),
            ev.Leaving: _LEAVE_NOW,
        },
        Phase.FINISHING: {
            **_AROUND,
            ev.Finished: Go(PartCore._finished, Phase.CLOSING),
            ev.OpFailed: Go(PartCore._finish_failed),
        },
        Phase.LEAVING: {
            **_AROUND,
            ev.Left: Go(PartCore._left, Phase.CLOSING),
            ev.OpFailed: Go(PartCore._left, Phase.CLOSING),
        },
        Phase.CLOSING: _rows(
            CheckpointsChanged=HEARD,
            WorkersChanged=HEARD,
            WorkerAsked=HEARD,
            TimerFired=HEARD,
            Progressed=HEARD,
            RanksHung=HEARD,
            NodesLost=HEARD,
            JobEnded=HEARD,
            Leaving=HEARD,
            OpFailed=HEARD,
        ),
    },
)
