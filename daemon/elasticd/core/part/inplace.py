"""An in-place job (``--in-place``): a policy of the part's machine (machine.py), pure.

A round holds only workers that are up and asked for a place (they run ``elastic.run``). A
worker that failed is replaced by a new process that warms up (imports, builds its model)
while the others train on; once it asks for a place its node opens a scale-up round, so
nobody waits for a newcomer's start-up.  The survivors of a round keep their processes:
they are told to abort their collectives when a member is gone, and hear their new place.

The slots and their states are the part's pool (pool.py).  A job's first round is formed
before its workers start (they are placed, then started).  Everything here drives the part
through its port (port.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.model import Failure, PartState, RunResult, WorkerState, placement_env
from elasticd.core.part.phases import Phase
from elasticd.core.part.pool import (
    LOSSES,
    ROUND_ENV,
    Pool,
    SlotState,
    aborts,
    ended,
    keeps_workers,
    notice,
    placed_group,
    renewed,
    round_group,
    standby,
)
from elasticd.core.part.port import PartPort
from elasticd.core.policy import (
    ROUND_FOR,
    Decision,
    Observed,
    RejoinStalled,
    WorkersExited,
    WorkersReady,
    failure_outcome,
    run_result,
)
from elasticd.journal import excerpt
from elasticd.rendezvous import Reason, RendezvousInfo, RoundEvent

Instructions = list[do.Instruction]

WARM_FAILURE = (
    "failed while warming up, before it asked for its place (an --in-place job's "
    "script must call elasticd.elastic.run)"
)


def round_result(part: PartPort) -> RunResult | None:
    """How this node's share of the round ended: any worker's failure (one that failed
    before it asked for a place says so, as in ``warm_exited``); success once every *placed*
    worker succeeded (one still warming up has no place to finish; the job's end stops it).
    A member with no worker placed never succeeds by itself: the exit barrier does not wait
    for it."""
    group, pool = part.group, pool_of(part)
    assert group is not None
    result = run_result(group, part.failures)
    if result is not None and result.state is WorkerState.FAILED:
        unasked = {
            w.local_rank for w in group.workers if w.rank < 0 and not pool.has_asked(w.local_rank)
        }
        return RunResult(
            WorkerState.FAILED,
            tuple(
                replace(f, message=f"{WARM_FAILURE}: {f.message}") if f.local_rank in unasked else f
                for f in result.failures
            ),
        )
    placed = tuple(w for w in group.workers if w.rank >= 0)
    if placed and all(w.state is WorkerState.SUCCEEDED for w in placed):
        return RunResult(WorkerState.SUCCEEDED)
    return None


def died_before_its_place(part: PartPort, result: RunResult) -> bool:
    """Whether every worker that failed was carried into this round from an older one and
    never asked for its place here: it was dying when the round was opened (a rank that
    raises takes seconds to exit, while its peers' broken collective re-forms the job)."""
    pool = pool_of(part)
    slots = {f.local_rank for f in result.failures}
    return bool(slots) and all(
        slot in pool.survivors and pool.asked.get(slot, -2) < pool.survivors[slot] for slot in slots
    )


def pool_size(part: PartPort) -> int:
    """Slots of the part's pool: its workers' and its spares' (``--spares``)."""
    return part.nproc + part.spares


def pool_of(part: PartPort) -> Pool:
    assert part.pool is not None
    return part.pool


def _timer(part: PartPort, role: str, at: float) -> do.SetTimer:
    name = f"{role}/{part.new_op('timer-' + role)}"
    pool_of(part).timers[role] = name
    return do.SetTimer(name, at, job=part.job)


def _clear(part: PartPort, *roles: str) -> Instructions:
    pool = pool_of(part)
    out: Instructions = []
    for role in roles:
        name = pool.timers.pop(role, None)
        part.forget_op("timer-" + role)
        if name is not None:
            out.append(do.ClearTimer(name, job=part.job))
    return out


# -- the part's in-place steps --------------------------------------------------------------


def begin(part: PartPort, now: ev.Now) -> Instructions:
    """A standby pool (every slot, none started); the job's first round is joined before its
    workers start; a job that ran already is joined by warmed-up workers."""
    pool = pool_of(part)
    pool.first = part.started is None
    group = standby(part.job, part.settings.node, pool_size(part), part.gpus)
    part.regroup(group)
    out: Instructions = [do.NewPool(part.job, group)]
    out += part.report(PartState.RENDEZVOUS, now, None, group)
    if pool.first:
        pool.joining = tuple(range(part.nproc))
        return out + part.join(now)
    return out + next_round(part, None, now)


def next_round(part: PartPort, previous: RendezvousInfo | None, now: ev.Now) -> Instructions:
    """Warm up workers for the slots that have none; join with those that asked for a place
    (the survivors).  A member of ``previous`` joins even with none: it stays a member with
    zero workers while its new ones warm up, so that a round at ``min`` nodes trains on (at
    ``--nnodes 2:2`` a lost worker does not stop its peer); they ask, and a scale-up round
    takes them in.  A node new to the job waits for its workers to ask first."""
    pool = pool_of(part)
    out: Instructions = []
    missing = tuple(slot for slot in pool.own(pool_size(part)) if slot not in pool.running())
    if missing:
        out.append(do.ForgetSlots(part.job, missing))
        for slot in missing:
            pool.forget(slot)
            pool.move(slot, SlotState.WARMING)
        assert part.group is not None
        part.regroup(renewed(part.group, missing))
        out.append(do.WarmWorkers(part.job, missing, previous.round + 1 if previous else 0))
        out += _warm_deadlines(part, missing, now) + part.workers_run(now)
    ready = pool.offered(
        (slot for slot in pool.running() if pool.has_asked(slot)), part.nproc + pool.extra
    )
    # a member stays one, with no worker while they warm up
    if ready or (previous is not None and not pool.fresh):
        pool.joining = ready
        return out + part.join(now, len(ready))
    return out + _warm(part, now)


def _warm(part: PartPort, now: ev.Now) -> Instructions:
    part.move_to(Phase.WARMING)
    return _warm_check(part, now)


def _warm_check(part: PartPort, now: ev.Now) -> Instructions:
    """Join once every running worker asked for a place; a worker that ended while warming
    up means this node leaves the job (it goes on elsewhere); the job's end or this node's
    leaving, heard already, comes next."""
    pool = pool_of(part)
    running = pool.running()
    asked = [slot for slot in running if pool.has_asked(slot)]
    if running and (len(asked) == len(running) or len(asked) >= part.nproc):  # spares may warm
        pool.joining = pool.offered(asked, part.nproc)
        return part.join(now, len(pool.joining))
    if part.group is not None and (
        not running or run_result(part.group, part.failures) is not None
    ):
        return warm_exited(part, now)
    if part.ended is not None:
        return part.drop() + part.end(PartState.STOPPED, now)
    if part.leaving is not None:
        return part.depart(now, None, part.group)
    return []


def warm_asked(part: PartPort, event: ev.WorkerAsked, now: ev.Now) -> Instructions:
    pool_of(part).ask(event.slot, event.after)
    return _warm_check(part, now)


def warm_exited(part: PartPort, now: ev.Now) -> Instructions:
    """A worker ended while warming up: a failure like any other.  It spends a restart (the
    round after the current one, whichever it is: this node is outside it) and the job
    fails once none is left, saying that the script must call elastic.run (a script that
    never does ends here every time); the survivors elsewhere keep their processes.  While
    no round is complete the job-wide budget cannot be charged, so this part counts too:
    more warm-up failures in a row than the budget fail the job."""
    assert part.group is not None
    pool = pool_of(part)
    result = run_result(part.group, part.failures)
    if result is None and pool.running():
        return []
    if part.ended is not None:
        return part.drop() + part.end(PartState.STOPPED, now)
    if part.leaving is not None:
        return part.depart(now, None, part.group)
    seen = WorkersExited(_warm_failure(part, result))
    cause = seen.result.root_cause
    assert cause is not None
    said: Instructions = [
        do.Say(
            "warning",
            "job %s: a worker on %s %s",
            part.job,
            (part.job, part.settings.node, excerpt(cause.message)),
        )
    ]
    pool.warm_failures += 1
    if pool.warm_failures > part.spec.max_restarts:
        outcome = failure_outcome(seen.result, part.spec, now.wall, part.settings.node)
        return said + part.finish(outcome, PartState.FAILED, now, part.info, part.group)
    return said + part.request(Reason.FAILURE, seen, now, current=True)


def _warm_failure(part: PartPort, result: RunResult | None) -> RunResult:
    """What failed while warming up, each cause saying so (a worker that ended without a
    failure, having never asked, is one too)."""
    assert part.group is not None
    causes = result.failures if result is not None and result.state is WorkerState.FAILED else ()
    if not causes:
        causes = tuple(
            Failure(w.rank, w.local_rank, w.node, w.exit_code or 0, "exited")
            for w in part.group.workers
            if w.local_rank in ended(part.group)
        )
    return RunResult(
        WorkerState.FAILED,
        tuple(replace(f, message=f"{WARM_FAILURE}: {f.message}") for f in causes),
    )


def joined(part: PartPort, info: RendezvousInfo, now: ev.Now) -> Instructions:
    """A round formed with this node: place its workers (the job's first round: start
    them); then watch the round."""
    pool = pool_of(part)
    previous = part.info
    pool.fresh = False
    out = _place_workers(part, info, None if pool.first else previous, pool.joining, now)
    if pool.first:
        pool.first = False
        assert part.group is not None
        out.append(do.StartWorkers(part.job, part.group, info.round, pool=True))
        spares = tuple(range(part.nproc, pool_size(part)))
        for slot in spares:  # the spares start unplaced
            pool.move(slot, SlotState.WARMING)
        out += _warm_deadlines(part, spares, now)
    if previous is not None and info.reason in LOSSES:  # the size to keep is the one before
        pool.keep = max(pool.keep, previous.world_size)
    else:
        pool.keep = info.world_size
    out += part.watch(now, notice_waiting=True)
    return out + (_take_in(part, now) or _fill(part, now))  # asks heard while joining count now


def _fill(part: PartPort, now: ev.Now) -> Instructions:
    """The job is smaller than before its last losses: the first members (by group rank),
    one spare each, fill in for what was lost, through a scale-up round.  The others train
    on meanwhile; the fill lasts until a node or a newcomer scales the job up again."""
    pool, info = pool_of(part), part.info
    assert info is not None
    spares = pool.parked()
    if (
        part.phase is not Phase.RUNNING
        or not part.spares
        or not spares
        or info.group_rank >= pool.keep - info.world_size
    ):
        return []
    extra = pool.extra + 1
    out = part.observe(WorkersReady(tuple(spares[:1])), now)  # a scale-up: it puts extra back to 0
    pool.extra = extra
    return out


def _place_workers(
    part: PartPort,
    info: RendezvousInfo,
    previous: RendezvousInfo | None,
    slots: Iterable[int],
    now: ev.Now,
) -> Instructions:
    """Tell each kept worker its place in ``info``; survivors hear of the change and must
    ask for their new place within the rejoin timeout when they were told to abort."""
    pool = pool_of(part)
    group = round_group(info, part.settings.node, part.job, slots, part.gpus)
    envs = {
        w.local_rank: {**placement_env(group, w), ROUND_ENV: str(info.round)} for w in group.workers
    }
    out: Instructions = [do.PlaceWorkers(part.job, group, envs)]
    change = notice(previous, info)
    if change.abort and pool.aborted < info.round:
        out.append(do.Notify(part.job, info.round, abort=True))
        pool.aborted = info.round
    out.append(do.Notify(part.job, info.round, added=change.added))
    out += _clear(part, "suspect", "rejoin")
    # a survivor: placed in a round older than the newest one its workers were told to abort
    # for (that abort may have been told for a round before this one: a node declared lost,
    # back as a newcomer, told to abort for round 1 and joining round 2)
    pool.survivors = {
        w.local_rank: pool.placed[w.local_rank]
        for w in group.workers
        if pool.placed.get(w.local_rank, pool.aborted) < pool.aborted
    }
    if pool.survivors:
        out.append(_timer(part, "rejoin", now.mono + part.spec.rejoin_timeout))
    for worker in group.workers:
        pool.placed[worker.local_rank] = info.round
        pool.move(worker.local_rank, SlotState.PLACED)
    offered = {w.local_rank for w in group.workers}
    stepping_back = [
        s for s, state in pool.slots.items() if state is SlotState.PLACED and s not in offered
    ]
    for slot in stepping_back:
        pool.move(slot, SlotState.READY)  # a spare that filled in steps back
    pool.suspect = pool.suspected = None
    assert part.group is not None
    return out + part.enter_round(info, placed_group(part.group, group), now)


def noted_asked(part: PartPort, event: ev.WorkerAsked, now: ev.Now) -> Instructions:
    """Between rounds: the ask is remembered, not acted on.  A survivor told to abort asks
    at once, often while the next round is still being joined; forgetting that made the
    rejoin timer of the round it then trained in call it late, and stall the job."""
    pool_of(part).ask(event.slot, event.after)
    return []


def running_asked(part: PartPort, event: ev.WorkerAsked, now: ev.Now) -> Instructions:
    """News from a worker in a running round: a collective of this round failed (and
    nothing re-forms yet), or new workers are ready to be added."""
    pool = pool_of(part)
    pool.ask(event.slot, event.after)
    info, group = part.info, part.group
    assert info is not None and group is not None
    placed = {w.local_rank for w in group.workers if w.rank >= 0}
    if event.why == "failure" and event.after >= info.round and event.slot in placed:
        worker = group.workers[event.slot]
        failure = Failure(
            rank=worker.rank,
            local_rank=event.slot,
            node=part.settings.node,
            exit_code=1,
            message=f"a collective failed: {event.error}",
            timestamp=now.wall,
        )
        return _collective_failed(part, failure, now)
    taken = _take_in(part, now)
    if taken:
        return taken
    if pool.slots.get(event.slot) is SlotState.READY:
        # a spare parked: it may fill in, else the job shows it
        return _fill(part, now) or part.report(part.report_state, now, info, group)
    return []


def _take_in(part: PartPort, now: ev.Now) -> Instructions:
    """Workers that asked for a place and hold none, while the node has places left (spares
    stay parked): a scale-up round takes them in, once all that warm up asked or they fill
    the places."""
    pool, group = pool_of(part), part.group
    assert group is not None
    if part.phase is not Phase.RUNNING:
        return []
    placed = {w.local_rank for w in group.workers if w.rank >= 0}
    warming = tuple(slot for slot in pool.running() if slot not in placed)
    ready = tuple(slot for slot in warming if pool.has_asked(slot))
    room = part.nproc - (len(pool.running()) - len(warming))
    if room > 0 and ready and (len(ready) == len(warming) or len(ready) >= room):
        return part.observe(WorkersReady(ready[:room]), now)
    return []


def _collective_failed(part: PartPort, failure: Failure, now: ev.Now) -> Instructions:
    """A dead member node re-forms the job at once (one probe); a dead worker shows itself
    (its exit here, its node's new round elsewhere).  Only when nothing does within
    ``dead_after`` is it a failure of its own."""
    pool = pool_of(part)
    assert part.info is not None
    others = tuple(m.node for m in part.info.members if m.node != part.settings.node)
    if not others:
        return _suspect(part, failure, now)
    pool.suspected = failure
    return part.drop("probe") + [
        do.Probe(part.job, part.new_op("probe"), others, part.settings.dead_after)
    ]


def running_probed(part: PartPort, event: ev.PeersProbed, now: ev.Now) -> Instructions:
    part.done(event)
    pool = pool_of(part)
    failure = pool.suspected
    assert failure is not None
    pool.suspected = None
    if event.lost:
        return part.observe(
            WorkersExited(RunResult(WorkerState.FAILED, (failure,)), event.lost), now
        )
    return _suspect(part, failure, now)


def _suspect(part: PartPort, failure: Failure, now: ev.Now) -> Instructions:
    pool = pool_of(part)
    if pool.suspect is not None:
        return []
    pool.suspect = failure
    return [_timer(part, "suspect", now.mono + part.settings.dead_after)]


def _warm_deadlines(part: PartPort, slots: Iterable[int], now: ev.Now) -> Instructions:
    """Workers that warm up must ask for their place within the job's join timeout: one
    that never does (a script that never calls ``elastic.run`` and just computes) would
    hold its slot, unplaced, for good."""
    pool = pool_of(part)
    for slot in slots:
        pool.warm_until[slot] = now.mono + part.spec.join_timeout
    return _arm_warmup(part)


def _arm_warmup(part: PartPort) -> Instructions:
    """One timer for the earliest deadline (a later warm-up's is later: the timer set for an
    earlier one fires first, and sets the next)."""
    pool = pool_of(part)
    if "warmup" in pool.timers or not pool.warm_until:
        return []
    return [_timer(part, "warmup", min(pool.warm_until.values()))]


def _warmup_over(part: PartPort, now: ev.Now) -> Instructions:
    """Warm-ups past their deadline are stopped as failed (their ends come back as any
    failure does: a restart is spent, or the job fails)."""
    pool = pool_of(part)
    late = tuple(
        sorted(
            slot
            for slot, until in pool.warm_until.items()
            if until <= now.mono and pool.slots.get(slot) is SlotState.WARMING
        )
    )
    for slot in late:
        del pool.warm_until[slot]
    out: Instructions = []
    if late:
        why = (
            f"did not ask for its place within {part.spec.join_timeout:g} s of its start "
            "(the job's join timeout)"
        )
        out += [
            do.Say(
                "warning",
                "job %s: workers in slots %s on %s %s: stopping them",
                part.job,
                (part.job, list(late), part.settings.node, why),
            ),
            do.FailSlots(part.job, late, why),
        ]
    return out + _arm_warmup(part)


def _timer_role(part: PartPort, event: ev.TimerFired) -> str | None:
    """The role of the timer that fired, if it is still the current one of its role."""
    pool = pool_of(part)
    return next((role for role, name in pool.timers.items() if name == event.name), None)


def timer_aside(part: PartPort, event: ev.TimerFired, now: ev.Now) -> Instructions:
    """Outside a running round only the warm-up deadline counts (the others are of a round)."""
    if part.pool is None or _timer_role(part, event) != "warmup":
        return []
    pool_of(part).timers.pop("warmup")
    return _warmup_over(part, now)


def timer(part: PartPort, event: ev.TimerFired, now: ev.Now) -> Instructions:
    pool = pool_of(part)
    role = _timer_role(part, event)
    if role is None:
        return []  # a timer of an earlier round
    pool.timers.pop(role)
    if role == "warmup":
        return _warmup_over(part, now)
    if role == "suspect" and pool.suspect is not None:
        return part.observe(WorkersExited(RunResult(WorkerState.FAILED, (pool.suspect,))), now)
    if role == "rejoin":
        late = tuple(
            slot
            for slot, old in pool.survivors.items()
            if slot in pool.running() and pool.asked.get(slot, -2) < old
        )
        if late:
            return part.observe(RejoinStalled(late), now)
    return []


def act(part: PartPort, decision: Decision, seen: Observed, now: ev.Now) -> Instructions | None:
    """Membership changes keep the workers (they are told); the rest is as for any part
    (None).  A stall restarts every worker: the pool starts afresh."""
    assert part.info is not None
    if decision is Decision.REJOIN:
        assert isinstance(seen, RoundEvent) and seen.reason is not None
        reason: Reason | None = seen.reason
    else:
        reason = ROUND_FOR.get(decision)
    if reason is None:
        return None
    pool = pool_of(part)
    if reason is Reason.SCALE_UP:
        # a node or a newcomer comes: spares that filled in step back (a fill sets it after)
        pool.extra = 0
    out = _clear(part, "suspect", "rejoin")
    out += part.report(PartState.RESTARTING, now, part.info, part.group)
    if not keeps_workers(reason):
        return out + part.stop_then(decision, seen, reason=reason, new_pool=True)
    if aborts(reason):
        out.append(do.Notify(part.job, part.info.round + 1, abort=True))
        pool.aborted = part.info.round + 1
    lost = seen.lost if isinstance(seen, WorkersExited) else ()
    if reason in LOSSES and part.spares:
        kept = (
            seen.nodes
            if isinstance(seen, RoundEvent)
            else tuple(m.node for m in part.info.members if m.node not in lost)
        )
        pool.extra += _fill_share(part, kept)
    if decision is Decision.REJOIN:
        return out + part.rejoin(now)
    return out + part.request(reason, seen, now, lost)


def _fill_share(part: PartPort, kept: Iterable[str]) -> int:
    """After a loss, the parked spares this node adds to its next round, so that the round
    is back at the size before the loss at once (a fill after it would re-form everyone a
    second time): the kept members fill the workers lost, one spare each in group-rank
    order, round and round.  0 when the nodes kept are not known."""
    pool, info = pool_of(part), part.info
    assert info is not None
    names = set(kept)
    members = [m for m in info.members if m.node in names]
    me = next((i for i, m in enumerate(members) if m.node == part.settings.node), None)
    if me is None:
        return 0
    lost = max(pool.keep, info.world_size) - sum(m.nproc for m in members)
    share = lost // len(members) + (me < lost % len(members))
    return max(0, min(share, len(pool.parked())))


def fresh_pool(part: PartPort, now: ev.Now) -> Instructions:
    """After a stall: every worker stopped; a new standby pool takes their slots."""
    pool = pool_of(part)
    group = standby(part.job, part.settings.node, pool.width(pool_size(part)), part.gpus)
    part.regroup(group)
    pool.fresh = True  # no member keeps a worker: none joins before its new ones ask
    for slot in list(pool.slots):
        if pool.slots[slot] is not SlotState.EMPTY:
            pool.move(slot, SlotState.EMPTY)
    return [do.NewPool(part.job, group)]
