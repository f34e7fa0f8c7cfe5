"""An in-place job (``--in-place``): a policy of the part's machine (core/part.py), pure.

A round holds only workers that are up and asked for a place (they run ``elastic.run``). A
worker that failed is replaced by a new process that warms up (imports, builds its model)
while the others train on; once it asks for a place its node opens a scale-up round, so
nobody waits for a newcomer's start-up.  The survivors of a round keep their processes:
they are told to abort their collectives when a member is gone, and hear their new place.

Each slot (a local rank) goes through SLOT_STATES: EMPTY (no process) -> WARMING (started,
not asked yet) -> READY (asked for a place) -> PLACED (in a round); its process's end makes
it EMPTY again.  A job's first round is formed before its workers start (they are placed,
then started).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.model import (
    Failure,
    PartState,
    RunResult,
    StateTable,
    Worker,
    WorkerGroup,
    WorkerState,
    placement_env,
)
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
from elasticd.core.records import Part  # noqa: F401  (re-exported for type readers)
from elasticd.journal import excerpt
from elasticd.rendezvous import Reason, RendezvousInfo, RoundEvent

if TYPE_CHECKING:
    from elasticd.core.part import PartCore

Instructions = list[do.Instruction]

LOSSES = frozenset(
    {Reason.FAILURE, Reason.NODE_LOST}
)  # rounds after which spares fill the old size
ABORTING = frozenset(
    {
        Reason.FAILURE,
        Reason.NODE_LOST,
        Reason.DRAIN,
        Reason.SHUTDOWN,
        Reason.RECLAIM,
        Reason.STALLED,
    }
)  # rounds whose old group has lost a member
ROUND_ENV = "ELASTICD_ROUND"


class SlotState(enum.StrEnum):
    EMPTY = "empty"  # no process
    WARMING = "warming"  # started, has not asked for a place
    READY = "ready"  # asked for a place
    PLACED = "placed"  # in a round


SLOT_STATES = StateTable(
    "an in-place slot",
    {
        SlotState.EMPTY: (SlotState.WARMING, SlotState.PLACED),  # PLACED: a first round's worker
        SlotState.WARMING: (SlotState.READY, SlotState.EMPTY),
        SlotState.READY: (SlotState.PLACED, SlotState.EMPTY),
        SlotState.PLACED: (
            SlotState.EMPTY,
            SlotState.READY,
        ),  # READY: a spare that filled in steps back
    },
)


def keeps_workers(reason: Reason) -> bool:
    """Whether an in-place job's workers live on into a round opened for ``reason``."""
    return reason is not Reason.STALLED


def aborts(reason: Reason) -> bool:
    """Whether the survivors' group must be aborted at once: someone in it is gone."""
    return reason in ABORTING


@dataclass(frozen=True)
class Notice:
    abort: bool  # a member of the previous round is missing or has fewer workers
    added: bool  # a node is new or has more workers (the newcomers need the state)


def notice(previous: RendezvousInfo | None, current: RendezvousInfo) -> Notice:
    """What the survivors of ``previous`` hear when ``current`` is formed."""
    if previous is None:
        return Notice(False, False)
    before = {m.node: m.nproc for m in previous.members}
    after = {m.node: m.nproc for m in current.members}
    removed = any(after.get(node, 0) < n for node, n in before.items())
    added = any(before.get(node, 0) < n for node, n in after.items())
    return Notice(removed, added)


def place(
    info: RendezvousInfo, node: str, job_id: str, slots: Iterable[int], gpus: tuple[str, ...] = ()
) -> WorkerGroup:
    """This node's workers in ``info``: the given slots (kept first, in slot order) take the
    ranks ``rank_base + i``; LOCAL_RANK stays the slot (it names the worker's device)."""
    workers = tuple(
        Worker(local_rank=slot, rank=info.rank_base + i, world_size=info.world_size, node=node)
        for i, slot in enumerate(sorted(slots))
    )
    return WorkerGroup(
        job_id,
        info.round,
        info.restart_count,
        info.group_rank,
        info.group_world_size,
        info.rank_base,
        info.world_size,
        info.master_addr,
        info.master_port,
        workers,
        gpus,
    )


def standby(job_id: str, node: str, nproc: int, gpus: tuple[str, ...] = ()) -> WorkerGroup:
    """Every slot, none placed yet (round -1: workers get no rank in their environment)."""
    workers = tuple(Worker(local_rank=i, rank=-1, world_size=0, node=node) for i in range(nproc))
    return WorkerGroup(job_id, -1, 0, -1, 0, -1, 0, "", 0, workers, gpus)


def placed_group(pool: WorkerGroup, group: WorkerGroup) -> WorkerGroup:
    """The pool once ``group`` placed it: the round's ranks, each worker's pid and state kept
    (one with no place in it has no rank)."""
    by_slot = {w.local_rank: w for w in group.workers}
    workers = tuple(
        Worker(
            old.local_rank,
            by_slot[old.local_rank].rank,
            by_slot[old.local_rank].world_size,
            old.node,
            old.pid,
            old.state,
            old.exit_code,
        )
        if old.local_rank in by_slot
        else replace(old, rank=-1, world_size=0)
        for old in pool.workers
    )
    return WorkerGroup(
        group.job_id,
        group.round,
        group.restart_count,
        group.group_rank,
        group.group_world_size,
        group.rank_base,
        group.world_size,
        group.master_addr,
        group.master_port,
        workers,
        group.gpus,
    )


def renewed(pool: WorkerGroup, slots: Iterable[int]) -> WorkerGroup:
    """The pool with new (INIT, unplaced) workers in ``slots``, as a warm-up makes them."""
    fresh = set(slots)
    workers = tuple(
        Worker(w.local_rank, -1, 0, w.node) if w.local_rank in fresh else w for w in pool.workers
    )
    return WorkerGroup(
        pool.job_id,
        pool.round,
        pool.restart_count,
        pool.group_rank,
        pool.group_world_size,
        pool.rank_base,
        pool.world_size,
        pool.master_addr,
        pool.master_port,
        workers,
        pool.gpus,
    )


def round_result(part: PartCore) -> RunResult | None:
    """How this node's share of the round ended: any worker's failure (one that failed
    before it asked for a place says so, as in ``warm_exited``); success once every *placed*
    worker succeeded (one still warming up has no place to finish; the job's end stops it).
    A member with no worker placed never succeeds by itself: the exit barrier does not wait
    for it."""
    group, places = part.group, _places(part)
    assert group is not None
    result = run_result(group, part.failures)
    if result is not None and result.state is WorkerState.FAILED:
        unasked = {
            w.local_rank for w in group.workers if w.rank < 0 and not places.has_asked(w.local_rank)
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


def ended(group: WorkerGroup) -> set[int]:
    """Slots whose worker's process ended."""
    return {
        w.local_rank
        for w in group.workers
        if w.state in (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED)
    }


@dataclass
class Places:
    """An in-place part's slots: what each asked for, where each was placed."""

    slots: dict[int, SlotState] = field(default_factory=dict)
    asked: dict[int, int] = field(
        default_factory=dict
    )  # slot -> the round it last asked to leave behind (-1: its first)
    placed: dict[int, int] = field(default_factory=dict)  # slot -> the round it was last placed in
    aborted: int = -1  # the newest round the workers were told to abort for
    survivors: dict[int, int] = field(
        default_factory=dict
    )  # slot -> its old round, while they must rejoin
    suspect: Failure | None = None  # a collective failed: the job fails with it, unless...
    suspected: Failure | None = None  # a collective failure whose peers are being probed
    joining: tuple[int, ...] = ()  # the slots offered to the round being joined
    first: bool = False  # the job's first round: its workers start once formed
    timers: dict[str, str] = field(default_factory=dict)  # role -> the name of its timer now
    warm_failures: int = 0  # warm-ups that failed since a worker last asked
    keep: int = 0  # the world size to keep: before the last losses
    extra: int = 0  # spares placed beyond nproc, filling in for a lost node
    fresh: bool = False  # every worker was stopped (a stall): all start anew
    given: set[int] = field(
        default_factory=set
    )  # slots given back to the node: no worker runs there again

    def move(self, slot: int, state: SlotState) -> None:
        self.slots[slot] = SLOT_STATES.check(self.slots.get(slot, SlotState.EMPTY), state)

    def ask(self, slot: int, after: int) -> None:
        """The worker in ``slot`` asked for a place (one whose end was heard first is gone)."""
        self.asked[slot] = max(self.asked.get(slot, -2), after)
        self.warm_failures = 0  # it reached elastic.run: the script is able to
        if self.slots.get(slot, SlotState.EMPTY) in (SlotState.WARMING, SlotState.READY):
            self.move(slot, SlotState.READY)

    def has_asked(self, slot: int) -> bool:
        return self.asked.get(slot, -2) >= -1

    def running(self) -> list[int]:
        """Slots whose worker runs (started, or placed to start)."""
        return sorted(slot for slot, state in self.slots.items() if state is not SlotState.EMPTY)

    def sync(self, group: WorkerGroup) -> None:
        """A worker whose process ended leaves its slot EMPTY."""
        for slot in ended(group):
            if self.slots.get(slot, SlotState.EMPTY) is not SlotState.EMPTY:
                self.move(slot, SlotState.EMPTY)


def pool_size(part: PartCore) -> int:
    """Slots of the part's pool: its workers' and its spares' (``--spares``)."""
    return part.nproc + part.spares


def parked(part: PartCore) -> int:
    """Spares ready now: workers that asked for a place and hold none."""
    return len(_parked_slots(_places(part)))


def _parked_slots(places: Places) -> list[int]:
    return sorted(slot for slot, state in places.slots.items() if state is SlotState.READY)


def _offered(places: Places, slots: Iterable[int], nproc: int) -> tuple[int, ...]:
    """What a join offers of the workers that asked: those placed before first (survivors
    keep their places), then spares, at most ``nproc``."""
    return tuple(
        sorted(slots, key=lambda s: (places.slots.get(s) is not SlotState.PLACED, s))[:nproc]
    )


def _places(part: PartCore) -> Places:
    assert part.place is not None
    return part.place


def _timer(part: PartCore, role: str, at: float) -> do.SetTimer:
    places = _places(part)
    name = f"{role}/{part._op('timer-' + role)}"
    places.timers[role] = name
    return do.SetTimer(name, at, job=part.job)


def _clear(part: PartCore, *roles: str) -> Instructions:
    places = _places(part)
    out: Instructions = []
    for role in roles:
        name = places.timers.pop(role, None)
        part.ops.pop("timer-" + role, None)
        if name is not None:
            out.append(do.ClearTimer(name, job=part.job))
    return out


# -- the part's in-place steps --------------------------------------------------------------


def begin(part: PartCore, now: ev.Now) -> Instructions:
    """A standby pool (every slot, none started); the job's first round is joined before its
    workers start; a job that ran already is joined by warmed-up workers."""
    places = _places(part)
    places.first = part.started is None
    part.group = standby(part.job, part.settings.node, pool_size(part), part.gpus)
    out: Instructions = [do.NewPool(part.job, part.group)]
    out += part._report(PartState.RENDEZVOUS, now, None, part.group)
    if places.first:
        places.joining = tuple(range(part.nproc))
        return out + part._join(now)
    return out + next_round(part, None, now)


def rejoin(part: PartCore, now: ev.Now) -> Instructions:
    return next_round(part, part.info, now)


def next_round(part: PartCore, previous: RendezvousInfo | None, now: ev.Now) -> Instructions:
    """Warm up workers for the slots that have none; join with those that asked for a place
    (the survivors).  A member of ``previous`` joins even with none: it stays a member with
    zero workers while its new ones warm up, so that a round at ``min`` nodes trains on (at
    ``--nnodes 2:2`` a lost worker does not stop its peer); they ask, and a scale-up round
    takes them in.  A node new to the job waits for its workers to ask first."""
    places = _places(part)
    out: Instructions = []
    missing = tuple(slot for slot in pool_slots(part) if slot not in places.running())
    if missing:
        out.append(do.ForgetSlots(part.job, missing))
        for slot in missing:
            places.placed.pop(slot, None)
            places.asked.pop(slot, None)
            places.move(slot, SlotState.WARMING)
        assert part.group is not None
        part.group = renewed(part.group, missing)
        out.append(do.WarmWorkers(part.job, missing, previous.round + 1 if previous else 0))
    ready = _offered(
        places,
        (slot for slot in places.running() if places.has_asked(slot)),
        part.nproc + places.extra,
    )
    if ready or (
        previous is not None and not places.fresh
    ):  # a member stays one, with no worker while they warm up
        places.joining = ready
        return out + part._join(now, len(ready))
    return out + _warm(part, now)


def _warm(part: PartCore, now: ev.Now) -> Instructions:
    from elasticd.core.part import Phase

    part._to(Phase.WARMING)
    return _warm_check(part, now)


def _warm_check(part: PartCore, now: ev.Now) -> Instructions:
    """Join once every running worker asked for a place; a worker that ended while warming
    up means this node leaves the job (it goes on elsewhere); the job's end or this node's
    leaving, heard already, comes next."""
    places = _places(part)
    running = places.running()
    asked = [slot for slot in running if places.has_asked(slot)]
    if running and (
        len(asked) == len(running) or len(asked) >= part.nproc
    ):  # spares may still warm
        places.joining = _offered(places, asked, part.nproc)
        return part._join(now, len(places.joining))
    if part.group is not None and (
        not running or run_result(part.group, part.failures) is not None
    ):
        return warm_exited(part, now)
    if part.ended is not None:
        return part._drop() + part._end(PartState.STOPPED, now)
    if part.leaving is not None:
        return part._leave(now, None, part.group)
    return []


def warm_asked(part: PartCore, event: ev.WorkerAsked, now: ev.Now) -> Instructions:
    _places(part).ask(event.slot, event.after)
    return _warm_check(part, now)


WARM_FAILURE = (
    "failed while warming up, before it asked for its place (an --in-place job's "
    "script must call elasticd.elastic.run)"
)


def warm_exited(part: PartCore, now: ev.Now) -> Instructions:
    """A worker ended while warming up: a failure like any other.  It spends a restart (the
    round after the current one, whichever it is: this node is outside it) and the job
    fails once none is left, saying that the script must call elastic.run (a script that
    never does ends here every time); the survivors elsewhere keep their processes.  While
    no round is complete the job-wide budget cannot be charged, so this part counts too:
    more warm-up failures in a row than the budget fail the job."""
    assert part.group is not None
    places = _places(part)
    result = run_result(part.group, part.failures)
    if result is None and places.running():
        return []
    if part.ended is not None:
        return part._drop() + part._end(PartState.STOPPED, now)
    if part.leaving is not None:
        return part._leave(now, None, part.group)
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
    places.warm_failures += 1
    if places.warm_failures > part.spec.max_restarts:
        outcome = failure_outcome(seen.result, part.spec, now.wall, part.settings.node)
        return said + part._finish(outcome, PartState.FAILED, now, part.info, part.group)
    return said + part._request(Reason.FAILURE, seen, now, current=True)


def _warm_failure(part: PartCore, result: RunResult | None) -> RunResult:
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


def joined(part: PartCore, info: RendezvousInfo, now: ev.Now) -> Instructions:
    """A round formed with this node: place its workers (the job's first round: start
    them); then watch the round."""
    places = _places(part)
    previous = part.info
    places.fresh = False
    out = _place(part, info, None if places.first else previous, places.joining, now)
    if places.first:
        places.first = False
        assert part.group is not None
        out.append(do.StartWorkers(part.job, part.group, info.round, pool=True))
        for slot in range(part.nproc, pool_size(part)):  # the spares start unplaced
            places.move(slot, SlotState.WARMING)
    if previous is not None and info.reason in LOSSES:  # the size to keep is the one before
        places.keep = max(places.keep, previous.world_size)
    else:
        places.keep = info.world_size
    out += part._watch(now, notice_waiting=True)
    return out + (_take_in(part, now) or _fill(part, now))  # asks heard while joining count now


def _fill(part: PartCore, now: ev.Now) -> Instructions:
    """The job is smaller than before its last losses: the first members (by group rank),
    one spare each, fill in for what was lost, through a scale-up round.  The others train
    on meanwhile; the fill lasts until a node or a newcomer scales the job up again."""
    from elasticd.core.part import Phase

    places, info = _places(part), part.info
    assert info is not None
    spares = _parked_slots(places)
    if (
        part.phase is not Phase.RUNNING
        or not part.spares
        or not spares
        or info.group_rank >= places.keep - info.world_size
    ):
        return []
    extra = places.extra + 1
    out = part._observed(WorkersReady(spares[:1]), now)  # a scale-up: it puts extra back to 0
    places.extra = extra
    return out


def _place(
    part: PartCore,
    info: RendezvousInfo,
    previous: RendezvousInfo | None,
    slots: Iterable[int],
    now: ev.Now,
) -> Instructions:
    """Tell each kept worker its place in ``info``; survivors hear of the change and must
    ask for their new place within the rejoin timeout when they were told to abort."""
    places = _places(part)
    group = place(info, part.settings.node, part.job, slots, part.gpus)
    envs = {
        w.local_rank: {**placement_env(group, w), ROUND_ENV: str(info.round)} for w in group.workers
    }
    out: Instructions = [do.PlaceWorkers(part.job, group, envs)]
    change = notice(previous, info)
    if change.abort and places.aborted < info.round:
        out.append(do.Notify(part.job, info.round, abort=True))
        places.aborted = info.round
    out.append(do.Notify(part.job, info.round, added=change.added))
    out += _clear(part, "suspect", "rejoin")
    places.survivors = (
        {
            w.local_rank: places.placed[w.local_rank]
            for w in group.workers
            if w.local_rank in places.placed
        }
        if places.aborted >= info.round
        else {}
    )
    if places.survivors:
        out.append(_timer(part, "rejoin", now.mono + part.spec.rejoin_timeout))
    for worker in group.workers:
        places.placed[worker.local_rank] = info.round
        places.move(worker.local_rank, SlotState.PLACED)
    offered = {w.local_rank for w in group.workers}
    for slot in [
        s for s, state in places.slots.items() if state is SlotState.PLACED and s not in offered
    ]:
        places.move(slot, SlotState.READY)  # a spare that filled in steps back
    places.suspect = places.suspected = None
    assert part.group is not None
    part.info, part.group = info, placed_group(part.group, group)
    part.started = part.started or now.wall
    return out + part._report(PartState.RUNNING, now, info, part.group)


def noted_asked(part: PartCore, event: ev.WorkerAsked, now: ev.Now) -> Instructions:
    """Between rounds: the ask is remembered, not acted on.  A survivor told to abort asks
    at once, often while the next round is still being joined; forgetting that made the
    rejoin timer of the round it then trained in call it late, and stall the job."""
    _places(part).ask(event.slot, event.after)
    return []


def running_asked(part: PartCore, event: ev.WorkerAsked, now: ev.Now) -> Instructions:
    """News from a worker in a running round: a collective of this round failed (and
    nothing re-forms yet), or new workers are ready to be added."""
    places = _places(part)
    places.ask(event.slot, event.after)
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
    if (
        places.slots.get(event.slot) is SlotState.READY
    ):  # a spare parked: it may fill in, else the job shows it
        return _fill(part, now) or part._report(part.report_state, now, info, group)
    return []


def _take_in(part: PartCore, now: ev.Now) -> Instructions:
    """Workers that asked for a place and hold none, while the node has places left (spares
    stay parked): a scale-up round takes them in, once all that warm up asked or they fill
    the places."""
    from elasticd.core.part import Phase

    places, group = _places(part), part.group
    assert group is not None
    if part.phase is not Phase.RUNNING:
        return []
    placed = {w.local_rank for w in group.workers if w.rank >= 0}
    warming = tuple(slot for slot in places.running() if slot not in placed)
    ready = tuple(slot for slot in warming if places.has_asked(slot))
    room = part.nproc - (len(places.running()) - len(warming))
    if room > 0 and ready and (len(ready) == len(warming) or len(ready) >= room):
        return part._observed(WorkersReady(ready[:room]), now)
    return []


def _collective_failed(part: PartCore, failure: Failure, now: ev.Now) -> Instructions:
    """A dead member node re-forms the job at once (one probe); a dead worker shows itself
    (its exit here, its node's new round elsewhere).  Only when nothing does within
    ``dead_after`` is it a failure of its own."""
    places = _places(part)
    assert part.info is not None
    others = tuple(m.node for m in part.info.members if m.node != part.settings.node)
    if not others:
        return _suspect(part, failure, now)
    places.suspected = failure
    return part._drop("probe") + [
        do.Probe(part.job, part._op("probe"), others, part.settings.dead_after)
    ]


def running_probed(part: PartCore, event: ev.PeersProbed, now: ev.Now) -> Instructions:
    part._done(event)
    places = _places(part)
    failure = places.suspected
    assert failure is not None
    places.suspected = None
    if event.lost:
        return part._observed(
            WorkersExited(RunResult(WorkerState.FAILED, (failure,)), event.lost), now
        )
    return _suspect(part, failure, now)


def _suspect(part: PartCore, failure: Failure, now: ev.Now) -> Instructions:
    places = _places(part)
    if places.suspect is not None:
        return []
    places.suspect = failure
    return [_timer(part, "suspect", now.mono + part.settings.dead_after)]


def timer(part: PartCore, event: ev.TimerFired, now: ev.Now) -> Instructions:
    places = _places(part)
    role = next((role for role, name in places.timers.items() if name == event.name), None)
    if role is None:
        return []  # a timer of an earlier round
    places.timers.pop(role)
    if role == "suspect" and places.suspect is not None:
        return part._observed(WorkersExited(RunResult(WorkerState.FAILED, (places.suspect,))), now)
    if role == "rejoin":
        late = tuple(
            slot
            for slot, old in places.survivors.items()
            if slot in places.running() and places.asked.get(slot, -2) < old
        )
        if late:
            return part._observed(RejoinStalled(late), now)
    return []


def act(part: PartCore, decision: Decision, seen: Observed, now: ev.Now) -> Instructions | None:
    """Membership changes keep the workers (they are told); the rest is as for any part
    (None).  A stall restarts every worker: the pool starts afresh."""
    from elasticd.core.part import Then

    assert part.info is not None
    if decision is Decision.REJOIN:
        assert isinstance(seen, RoundEvent) and seen.reason is not None
        reason: Reason | None = seen.reason
    else:
        reason = ROUND_FOR.get(decision)
    if reason is None:
        return None
    places = _places(part)
    if reason is Reason.SCALE_UP:
        places.extra = (
            0  # a node or a newcomer comes: spares that filled in step back (a fill sets it after)
        )
    out = _clear(part, "suspect", "rejoin")
    out += part._report(PartState.RESTARTING, now, part.info, part.group)
    if not keeps_workers(reason):
        return out + part._stop_then(
            Then(decision=decision, seen=seen, reason=reason, new_pool=True)
        )
    if aborts(reason):
        out.append(do.Notify(part.job, part.info.round + 1, abort=True))
        places.aborted = part.info.round + 1
    lost = seen.lost if isinstance(seen, WorkersExited) else ()
    if reason in LOSSES and part.spares:
        kept = (
            seen.nodes
            if isinstance(seen, RoundEvent)
            else tuple(m.node for m in part.info.members if m.node not in lost)
        )
        places.extra += _fill_share(part, kept)
    if decision is Decision.REJOIN:
        return out + part._rejoin(now)
    return out + part._request(reason, seen, now, lost)


def _fill_share(part: PartCore, kept: Iterable[str]) -> int:
    """After a loss, the parked spares this node adds to its next round, so that the round
    is back at the size before the loss at once (a fill after it would re-form everyone a
    second time): the kept members fill the workers lost, one spare each in group-rank
    order, round and round.  0 when the nodes kept are not known."""
    places, info = _places(part), part.info
    assert info is not None
    names = set(kept)
    members = [m for m in info.members if m.node in names]
    me = next((i for i, m in enumerate(members) if m.node == part.settings.node), None)
    if me is None:
        return 0
    lost = max(places.keep, info.world_size) - sum(m.nproc for m in members)
    share = lost // len(members) + (me < lost % len(members))
    return max(0, min(share, len(_parked_slots(places))))


def fresh_pool(part: PartCore, now: ev.Now) -> Instructions:
    """After a stall: every worker stopped; a new standby pool takes their slots."""
    places = _places(part)
    part.group = standby(part.job, part.settings.node, pool_width(part), part.gpus)
    places.fresh = True  # no member keeps a worker: none joins before its new ones ask
    for slot in list(places.slots):
        if places.slots[slot] is not SlotState.EMPTY:
            places.move(slot, SlotState.EMPTY)
    return [do.NewPool(part.job, part.group)]


# -- the pool's slots, once spares were given back (core/spares.py) --------------------------


def pool_width(part: PartCore) -> int:
    """Slot numbers of the pool: its own slots and those it gave back (a slot keeps its
    number for good: LOCAL_RANK names the worker's device)."""
    return pool_size(part) + (len(part.place.given) if part.place is not None else 0)


def pool_slots(part: PartCore) -> list[int]:
    """The slots the pool holds: every slot number but those given back."""
    given = part.place.given if part.place is not None else set()
    return [slot for slot in range(pool_width(part)) if slot not in given]
