"""The node core: this node's side of every job, pure (dask's WorkerState).

``NodeCore.handle(event, now)`` takes every stimulus of this node (the job table changed,
an operation of a part completed, a worker changed, a timer fired, nodes were lost, the
operator drained the node ...), changes the node's state and returns the instructions the
shell carries out.  It is the one writer of this node's parts and of the outcomes it
decides: they leave as Publish and Finish instructions.

What it holds: one PartCore per job this node takes part in; the holds that keep this node
from taking jobs (drained, not listed, blacklisted) and the users whose jobs are kept off
it; the jobs it will not take again (declined until they change, held for good, failed to
start, refused by its rules).  Placement (core/placement.py) decides which open jobs it
offers itself to, oldest first.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.blacklist import USERS_FOR_NODE, Blacklist, worker_failures
from elasticd.core.gpuhealth import GpuWatch
from elasticd.core.model import JobSpec, JobState, PartState
from elasticd.core.part import PartCore, PartSettings, Pool, spares
from elasticd.core.placement import Offer, Resources, choose_offers, refusal
from elasticd.core.records import JobRecord, Outcome, Part
from elasticd.core.schedule import Schedule, follows, leaves
from elasticd.core.story import Story
from elasticd.core.tables import EventTable
from elasticd.rendezvous import Reason

Instructions = list[do.Instruction]
STORIES_KEPT = 64  # stories of parts that ended here, newest kept


class Hold(enum.StrEnum):
    """Why this node takes no new job and leaves its jobs (any one of them is enough)."""

    DRAINED = "drained by an operator"
    UNLISTED = "not listed by the discovery script"
    BLACKLISTED = "blacklisted"


@dataclass
class NodeSettings:
    node: str
    resources: Resources  # as configured (the discovery script may say other slots)
    dead_after: float
    standalone: bool = False
    allow_root: bool = False
    judge_users: bool = True  # a root daemon judges each job's user (a user's own runs its own)
    scheduled: bool = False  # the cluster's scheduler is on: place nothing before its first word


@dataclass
class NodeCore:
    settings: NodeSettings
    blacklist: Blacklist | None = None
    gpu_watch: GpuWatch | None = None  # NVML's health checks of this node's GPUs (None: no NVML)
    resources: Resources | None = None
    parts: dict[str, PartCore] = field(default_factory=dict)
    offers: dict[str, Offer] = field(default_factory=dict)
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    users: dict[int, str | None] = field(default_factory=dict)
    holds: set[Hold] = field(default_factory=set)
    listed: bool = True
    blacklisted_until: float = 0.0  # wall clock, shown (0: not blacklisted)
    declined: dict[str, int] = field(default_factory=dict)  # job -> its record's version then
    unstartable: set[str] = field(default_factory=set)
    refused: dict[str, str] = field(
        default_factory=dict
    )  # job -> why this node's rules forbid it ("": they allow it)
    held: dict[str, str] = field(default_factory=dict)  # job -> why this node never takes it again
    finishing: dict[str, int] = field(
        default_factory=dict
    )  # job -> the node's own finish op (cancel, shutdown)
    stopping: bool = False
    stories: dict[str, Story] = field(default_factory=dict)  # the stories of parts that ended here
    cooling_users: set[int] = field(default_factory=set)  # uids whose jobs are kept off for now
    next_op: int = 0
    schedule: Schedule | None = None  # the cluster's schedule, followed (None: first come)
    awaiting_schedule: bool = False  # scheduled, and the store's schedule not read yet
    # op -> the part giving spares back, their slots, to whom
    shedding: dict[int, tuple[PartCore, tuple[int, ...], str]] = field(default_factory=dict)
    # (job, node) -> what a node judged lost last said of a job: not a member for placement
    # (a full job takes a spare in its place) until that node says something newer
    lost_parts: dict[tuple[str, str], Part] = field(default_factory=dict)
    story: Story = field(default_factory=Story)  # the node's own: holds, placement, GPUs
    stimulus_id: str = ""  # the stimulus being handled: what the node does for it carries it

    def __post_init__(self) -> None:
        self.resources = self.resources or self.settings.resources
        self.awaiting_schedule = self.settings.scheduled

    # -- the one entry point -------------------------------------------------------------------

    def handle(self, event: ev.Event, now: ev.Now) -> Instructions:
        """The node's answer to ``event``: a part's own news goes to that part (none of a
        part that ended); the rest is the node's (NODE_EVENTS)."""
        self.stimulus_id = event.stimulus_id
        if isinstance(event, ev.PART_ONLY):
            part = self.parts.get(event.job)
            return self._from_part(part, event, now) if part is not None else []
        handler = NODE_EVENTS.lookup(
            NodePhase.STOPPING if self.stopping else NodePhase.SERVING, event
        )
        self.story.heard(now.mono, event)
        out = handler(self, event, now)
        self.story.told(now.mono, f"{type(event).__name__} [{event.stimulus_id}]", out)
        return out

    def _tell(self, part: PartCore, event: ev.PartEvent, now: ev.Now) -> Instructions:
        """Give ``part`` news the node learned (the job ended, this node leaves it, nodes
        were lost), named after the stimulus that taught it."""
        out = part.handle(replace(event, stimulus_id=self.stimulus_id), now)
        return self._outgoing(out, now)

    def _from_part(self, part: PartCore, event: ev.PartEvent, now: ev.Now) -> Instructions:
        out = self._outgoing(part.handle(event, now), now)
        if isinstance(event, ev.PeersProbed) and event.lost:  # news for every job here
            out += self._nodes_lost(ev.NodesLost(event.lost), now)
        return out

    # -- what parts say goes through here -----------------------------------------------------

    def _outgoing(self, out: Instructions, now: ev.Now) -> Instructions:
        """Instructions of parts, seen on their way out: a published part may blacklist this
        node or keep its user off it; a held job is never placed here again."""
        extra: Instructions = []
        for instruction in out:
            if isinstance(instruction, do.Publish):
                extra += self._count_failures(instruction.job, instruction.part, now)
            elif isinstance(instruction, do.HoldJob):
                self.held[instruction.job] = instruction.why
        return out + extra

    # -- the job table -------------------------------------------------------------------------

    def _jobs_changed(self, event: ev.JobsChanged, now: ev.Now) -> Instructions:
        self.jobs = {record.id: record for record in event.jobs}
        self.users.update(event.users)
        self.lost_parts = {  # a node that spoke again is back; an ended job is nobody's
            (job, node): part
            for (job, node), part in self.lost_parts.items()
            if (record := self.jobs.get(job)) is not None
            and record.outcome is None
            and record.parts.get(node) == part
        }
        out: Instructions = []
        for job, part in list(self.parts.items()):
            record = self.jobs.get(job)
            if record is not None and record.outcome is not None:
                out += self._tell(part, ev.JobEnded(job, record.outcome), now)
        return out + self._publish_holds(now) + self._reclaimed(now) + self._offer_self(now)

    def _schedule_changed(self, event: ev.ScheduleChanged, now: ev.Now) -> Instructions:
        """Follow the cluster's schedule: leave the jobs it gave other nodes, take those it
        gave this one.  Without one, this node places jobs itself."""
        self.schedule, self.awaiting_schedule = event.schedule, False
        for job, part in self.parts.items():
            part.scheduled = self._scheduled(job)
        return self._reclaimed(now) + self._offer_self(now)

    def _scheduled(self, job: str) -> frozenset[str]:
        return (
            self.schedule.nodes.get(job, frozenset()) if self.schedule is not None else frozenset()
        )

    def _reclaimed(self, now: ev.Now) -> Instructions:
        """This node's parts of open jobs that the schedule gave other nodes leave (a new
        round without this node: in place, the survivors keep their processes; no restart is
        spent)."""
        if self.schedule is None:
            return []
        out: Instructions = []
        for job, part in list(self.parts.items()):
            record = self.jobs.get(job)
            if (
                record is not None
                and record.outcome is None
                and leaves(self.schedule, job, self.settings.node)
                and part.leaving is None
            ):
                out += [
                    do.Count("reclaimed"),
                    *self._tell(part, ev.Leaving(job, Reason.RECLAIM), now),
                ]
        return out

    def _publish_holds(self, now: ev.Now) -> Instructions:
        """Every node shows a job that this node holds, and why: this node's part says so (a
        LEFT part when it has none: it never takes the job)."""
        out: Instructions = []
        for record in self.jobs.values():
            if not record.held or record.outcome is not None:
                continue
            own = record.parts.get(self.settings.node)
            if own is None or own.held != record.held:
                part = own or Part(self.settings.node, PartState.LEFT, updated=now.wall)
                out.append(do.Publish(record.id, replace(part, held=record.held)))
        return out

    def _offer_self(self, now: ev.Now) -> Instructions:
        """Offer this node to the open jobs it fits, oldest first (those the schedule gives
        it, where there is one; nothing before a scheduled node read the store's)."""
        if self.stopping or self.awaiting_schedule:
            return []
        assert self.resources is not None
        used = self.used()
        free = replace(
            self.resources,
            slots=self.resources.slots - used.slots,
            gpus=tuple(g for g in self.resources.gpus if g not in used.gpus),
        )
        records = list(self.jobs.values())
        if self.schedule is not None:
            schedule, node = self.schedule, self.settings.node
            records = [r for r in records if follows(schedule, r.id, node)]
        kept_off = self.blacklist.kept_off() if self.blacklist is not None else set()
        out: Instructions = []
        busy = (
            set(self.parts)
            | self.unstartable
            | set(self.held)
            | self._refused_here(records, out)
            | {
                r.id
                for r in records
                if self.declined.get(r.id) == r.version or r.spec.uid in kept_off
            }
        )
        for offer in choose_offers(
            records,
            self.settings.node,
            free,
            has_gpus=bool(self.settings.resources.gpus),
            busy=busy,
            draining=self.draining,
            lost=self.lost_parts,
        ):
            out += self._start_part(self.jobs[offer.job_id], offer, now)
            busy.add(offer.job_id)
            free = replace(
                free,
                slots=free.slots - offer.slots,
                gpus=tuple(g for g in free.gpus if g not in offer.gpus),
            )
        return out + self._reclaim_spares(records, free, busy, now)

    # -- spares given back (core/part/spares.py) -----------------------------------------------

    def _reclaim_spares(
        self, records: list[JobRecord], free: Resources, busy: set[str], now: ev.Now
    ) -> Instructions:
        """Jobs that fit only in the room of spares here: parts give spares back (the
        lowest-priority, newest job's first) and the jobs start once they are reaped (what
        is being given back already counts)."""
        holders = [
            spares.Holder(job, tuple(idle), spares.slot_gpus(self.parts[job], idle))
            for job in self._shed_order()
            if (idle := spares.sheddable(self.parts[job]))
        ]
        if not holders:
            return []
        has_gpus = bool(self.settings.resources.gpus)
        coming = spares.room(
            free,
            [
                (len(slots), spares.slot_gpus(part, slots))
                for part, slots, _ in self.shedding.values()
                if self.parts.get(part.job) is part
            ],
        )
        whole = spares.room(coming, [(len(h.slots), h.gpus) for h in holders])
        offers = choose_offers(
            records,
            self.settings.node,
            whole,
            has_gpus=has_gpus,
            busy=busy,
            draining=self.draining,
            lost=self.lost_parts,
        )
        out: Instructions = []
        for job, n in spares.plan(holders, spares.wanted(offers, coming, has_gpus)):
            slots, told = spares.shed(self.parts[job], n, now, self.stimulus_id)
            self.next_op -= 1
            self.shedding[self.next_op] = (
                self.parts[job],
                slots,
                ", ".join(o.job_id for o in offers),
            )
            out += self._outgoing(told, now) + [do.ShedSpares(job, self.next_op, slots)]
        return out

    def _shed_order(self) -> list[str]:
        """The parts here that may give spares back, the first to give first."""

        def rank(job: str) -> tuple[int, int]:
            record = self.jobs.get(job)
            return (record.spec.priority, -record.seq) if record is not None else (0, 0)

        return sorted((job for job, part in self.parts.items() if part.spares), key=rank)

    def _spares_shed(self, event: ev.SparesShed, now: ev.Now) -> Instructions:
        """Spares' processes are reaped: their slots and GPUs are free (they stay the part's
        if stopping them failed)."""
        part, _, to = self.shedding.pop(event.op, (None, (), ""))
        job, offer = event.job, self.offers.get(event.job)
        out: Instructions = []
        if (
            part is not None and offer is not None and self.parts.get(job) is part
        ):  # not a part that closed
            gone = spares.slot_gpus(part, event.slots)
            self.offers[job] = replace(
                offer,
                spares=offer.spares - len(event.slots),
                gpus=tuple(g for g in offer.gpus if g not in gone),
            )
            out.append(
                do.Say(
                    "info",
                    "job %s: gave back %d spare slots to job %s",
                    job,
                    (job, len(event.slots), to),
                )
                if event.slots
                else do.Say(
                    "warning",
                    "job %s: its spares given back to job %s could "
                    "not be stopped; their slots stay its own",
                    job,
                    (job, to),
                )
            )
        return out + self._offer_self(now)

    def _refused_here(self, records: list[JobRecord], out: Instructions) -> set[str]:
        """The open jobs that this node's own rules forbid (each judged once, and said)."""
        for record in records:
            if record.outcome is None and record.id not in self.refused:
                why = self._refusal(record)
                if why:
                    out.append(
                        do.Say(
                            "warning",
                            "job %s: not run on %s: %s",
                            record.id,
                            (record.id, self.settings.node, why),
                        )
                    )
                self.refused[record.id] = why
        return {job for job, why in self.refused.items() if why}

    def _refusal(self, record: JobRecord) -> str:
        if not self.settings.judge_users:
            return ""
        local_user = self.users.get(record.spec.uid)
        return (
            refusal(record.spec, allow_root=self.settings.allow_root, local_user=local_user) or ""
        )

    def _start_part(self, record: JobRecord, offer: Offer, now: ev.Now) -> Instructions:
        assert self.resources is not None
        spec = record.spec
        nproc = offer.nproc
        started = _started(record)
        part = PartCore(
            spec,
            nproc,
            offer.gpus,
            PartSettings(self.settings.node, self.settings.dead_after),
            started=started,
            pool=Pool() if spec.in_place else None,
            spares=offer.spares,
            scheduled=self._scheduled(spec.id),
        )
        first = part.start(now, self.stimulus_id)  # raises before the part is this node's
        self.parts[spec.id] = part
        self.offers[spec.id] = offer
        out: Instructions = [
            do.Say(
                "info",
                "job %s: joining with %d workers%s%s",
                spec.id,
                (
                    spec.id,
                    nproc,
                    f" and {offer.spares} spares" if offer.spares else "",
                    f" on GPUs {','.join(offer.gpus)}" if offer.gpus else "",
                ),
            ),
            do.StartPart(spec.id, spec, offer.slots, offer.gpus, started),
        ]
        return out + self._outgoing(first, now)

    def _part_closed(self, event: ev.PartClosed, now: ev.Now) -> Instructions:
        part = self.parts.pop(event.job, None)
        self.offers.pop(event.job, None)
        if part is None:
            return []
        self.stories[event.job] = part.story
        while len(self.stories) > STORIES_KEPT:
            del self.stories[next(iter(self.stories))]  # the oldest part's
        if part.declined and (record := self.jobs.get(event.job)) is not None:
            self.declined[event.job] = record.version  # not again until the job changes
        return self._offer_self(now)

    def _part_start_failed(self, event: ev.PartStartFailed, now: ev.Now) -> Instructions:
        """A job that cannot start here must not hold up the jobs behind it."""
        self.parts.pop(event.job, None)
        self.offers.pop(event.job, None)
        self.unstartable.add(event.job)
        return [
            do.Say(
                "error",
                "job %s: cannot start its agent on %s: %s",
                event.job,
                (event.job, self.settings.node, event.message),
            )
        ] + self._offer_self(now)

    # -- outcomes this node writes of its own -----------------------------------------------------

    def _restored(self, event: ev.Restored, now: ev.Now) -> Instructions:
        """Jobs a previous run left unfinished: a one-node cluster's are over (their store
        was in its memory); a larger one's part here ended (the job went on elsewhere)."""
        out: Instructions = []
        for record in event.jobs:
            part = record.parts.get(self.settings.node)
            if self.settings.standalone:
                ran = part is not None and part.started is not None
                message = (
                    f"daemon died: elasticd on {self.settings.node} stopped while the job ran"
                    if ran
                    else f"cancelled: elasticd on {self.settings.node} stopped before the job ran"
                )
                state = JobState.FAILED if ran else JobState.CANCELLED
                out += self._finish(
                    record.id,
                    Outcome(state, now.wall, None, message, None, self.settings.node),
                    record.spec,
                    board=False,
                )
            elif part is not None and part.state.active:
                out.append(
                    do.Publish(record.id, replace(part, state=PartState.LEFT, updated=now.wall))
                )
        return out

    def _cancel(self, event: ev.CancelAsked, now: ev.Now) -> Instructions:
        outcome = Outcome(
            JobState.CANCELLED, now.wall, None, f"cancelled by {event.by}", None, self.settings.node
        )
        return self._finish(event.job, outcome, event.spec)

    def _finish(
        self, job: str, outcome: Outcome, spec: JobSpec | None, board: bool = True
    ) -> Instructions:
        """The node's own outcome of a job (a cancel, a shutdown): its operations are
        numbered below zero, so that none is taken for a part's."""
        self.next_op -= 1
        self.finishing[job] = self.next_op
        return [do.Finish(job, self.next_op, outcome, spec, board)]

    def _finished(self, event: ev.Finished, now: ev.Now) -> Instructions:
        """An outcome was written: a part's own (its completion), or the node's (a cancel, a
        shutdown); either way every part of the job hears that it ended."""
        part = self.parts.get(event.job)
        out: Instructions = []
        if event.op is not None and self.finishing.get(event.job) == event.op:
            del self.finishing[event.job]
        elif part is not None:
            out += self._from_part(part, event, now)
        if part is not None and event.job in self.parts:
            out += self._tell(part, ev.JobEnded(event.job, event.outcome), now)
        return out

    def _op_failed(self, event: ev.OpFailed, now: ev.Now) -> Instructions:
        if event.op is not None and self.finishing.get(event.job) == event.op:
            del self.finishing[event.job]
            return [
                do.Say(
                    "warning",
                    "job %s: could not record its outcome: %s",
                    event.job,
                    (event.job, event.message),
                )
            ]
        part = self.parts.get(event.job)
        return self._from_part(part, event, now) if part is not None else []

    # -- holds: drain, listing, blacklist -------------------------------------------------------

    @property
    def draining(self) -> bool:
        """Whether this node takes no new job and leaves its jobs, for any reason."""
        return bool(self.holds)

    def _hold(self, why: Hold, on: bool, now: ev.Now) -> Instructions:
        """A draining node takes no new job and leaves its jobs through a clean new round."""
        if (why in self.holds) == on:
            return []
        was = self.draining
        (self.holds.add if on else self.holds.discard)(why)
        out: Instructions = []
        if on and not was:
            out.append(
                do.Say(
                    "info",
                    "node %s: %s: it takes no new job%s",
                    None,
                    (self.settings.node, why.value, " and leaves its jobs" if self.parts else ""),
                )
            )
        elif on:
            out.append(do.Say("info", "node %s: %s", None, (self.settings.node, why.value)))
        elif not self.draining:
            out.append(do.Say("info", "node %s takes jobs again", None, (self.settings.node,)))
        if self.draining and not was:
            for part in list(self.parts.values()):
                out += self._tell(part, ev.Leaving(part.job, Reason.DRAIN), now)
        return out + self._offer_self(now)

    def _hold_changed(self, event: ev.HoldChanged, now: ev.Now) -> Instructions:
        """An operator's drain, or undrain: undrain also lifts every cooldown here."""
        why = Hold(event.hold)
        out: Instructions = []
        if (
            why is Hold.DRAINED
            and not event.on
            and self.blacklist is not None
            and self.blacklist.lift()
        ):
            out.append(
                do.Say(
                    "info",
                    "node %s: blacklisting lifted by an operator",
                    None,
                    (self.settings.node,),
                )
            )
            out += [do.ClearTimer("user-cooldown", key=uid) for uid in list(self.cooling_users)]
            self.cooling_users.clear()
            out += self._readmit(now)
        return out + self._hold(why, event.on, now)

    def _listed(self, event: ev.Listed, now: ev.Now) -> Instructions:
        """Not listed, the node is drained; listed with slots, it has that many."""
        self.listed = event.listed
        configured = self.settings.resources
        slots = event.slots if event.listed and event.slots else configured.slots
        out: Instructions = []
        assert self.resources is not None
        if slots != self.resources.slots:
            out.append(
                do.Say(
                    "info",
                    "node %s: %d slots (%s)",
                    None,
                    (
                        self.settings.node,
                        slots,
                        "from the discovery script" if slots != configured.slots else "configured",
                    ),
                )
            )
            self.resources = replace(self.resources, slots=slots)
        return out + self._hold(Hold.UNLISTED, not event.listed, now)

    # -- GPUs found bad --------------------------------------------------------------------------

    def _gpus_read(self, event: ev.GpusRead, now: ev.Now) -> Instructions:
        if self.gpu_watch is None:
            return []
        out, changed = self.gpu_watch.read(event.readings, now.mono, now.wall)
        return out + (self._offer_healthy_gpus(now) if changed else [])

    def _gpu_readmitted(self, event: ev.GpuReadmitted, now: ev.Now) -> Instructions:
        if self.gpu_watch is None:
            return [
                do.Say(
                    "warning",
                    "gpu %d not readmitted: this node does not watch its GPUs (no NVML)",
                    None,
                    (event.index,),
                )
            ]
        out = self.gpu_watch.readmit(event.index, f"readmitted by {event.by or 'an operator'}")
        return out + (self._offer_healthy_gpus(now) if out else [])

    def _offer_healthy_gpus(self, now: ev.Now) -> Instructions:
        """Offer only the GPUs not out; the jobs here that hold one that is out leave (a new
        round without this node: in place, the survivors keep their processes) and this node
        offers itself again with what is left."""
        assert self.resources is not None and self.gpu_watch is not None
        out_now = set(self.gpu_watch.out)
        self.resources = replace(
            self.resources, gpus=tuple(g for g in self.settings.resources.gpus if g not in out_now)
        )
        out: Instructions = []
        for job, offer in list(self.offers.items()):
            part = self.parts.get(job)
            if part is not None and part.leaving is None and out_now.intersection(offer.gpus):
                out += self._tell(part, ev.Leaving(job, Reason.DRAIN), now)
        return out + self._offer_self(now)

    def _count_failures(self, job: str, part: Part, now: ev.Now) -> Instructions:
        record = self.jobs.get(job)
        if self.blacklist is None or part.node != self.settings.node or record is None:
            return []
        out: Instructions = []
        for key in worker_failures(job, part):
            verdict = self.blacklist.failed(key, record.spec.uid, now.mono)
            if verdict.node_until is not None:
                out += self._blacklist_node(verdict.node_until, now)
            if verdict.user_until is not None:
                out += self._keep_off(record.spec.uid, record.spec.user, verdict.user_until, now)
        return out

    def _keep_off(self, uid: int, user: str, until: float, now: ev.Now) -> Instructions:
        """One user's jobs failed here too often: they leave this node and are not placed
        here until the cooldown ends; other users' jobs stay."""
        assert self.blacklist is not None
        out: Instructions = [
            do.Say(
                "warning",
                "node %s: jobs of %s kept off it for %.0f s: %d failures of their "
                "workers within %g s (%d in a row)",
                None,
                (
                    self.settings.node,
                    user,
                    until - now.mono,
                    self.blacklist.policy.failures,
                    self.blacklist.policy.window,
                    self.blacklist.user_strikes(uid),
                ),
            ),
            do.SetTimer("user-cooldown", until, key=uid),
        ]
        self.cooling_users.add(uid)
        if not self.draining:  # a draining node told every job to leave already
            for part in list(self.parts.values()):
                if part.spec.uid == uid:
                    out += self._tell(part, ev.Leaving(part.job, Reason.DRAIN), now)
        return out + self._offer_self(now)

    def _user_cooldown_over(self, uid: int, now: ev.Now) -> Instructions:
        """A user's cooldown ended (the timer goes again if it fired a moment early)."""
        assert self.blacklist is not None
        until = self.blacklist.user_until(uid)
        if until is not None and not self.blacklist.expire_user(uid, now.mono):
            return [do.SetTimer("user-cooldown", until, key=uid)]
        self.cooling_users.discard(uid)
        user = next((r.spec.user for r in self.jobs.values() if r.spec.uid == uid), str(uid))
        return [
            do.Say(
                "info", "node %s: jobs of %s may run here again", None, (self.settings.node, user)
            )
        ] + self._offer_self(now)

    def _blacklist_node(self, until: float, now: ev.Now) -> Instructions:
        """The jobs of several users failed here: the node takes no job for the cooldown."""
        assert self.blacklist is not None
        self.blacklisted_until = now.wall + (until - now.mono)
        out: Instructions = [
            do.Say(
                "warning",
                "node %s blacklisted for %.0f s: the workers of %d or more users' jobs "
                "failed %d times each within %g s (%d in a row)",
                None,
                (
                    self.settings.node,
                    until - now.mono,
                    USERS_FOR_NODE,
                    self.blacklist.policy.failures,
                    self.blacklist.policy.window,
                    self.blacklist.strikes,
                ),
            ),
            do.Count("blacklisted", value=1),
            do.SetTimer("cooldown", until),
        ]
        return out + self._hold(Hold.BLACKLISTED, True, now)

    def _node_timer(self, event: ev.NodeTimerFired, now: ev.Now) -> Instructions:
        if event.name == "user-cooldown" and isinstance(event.key, int):
            return self._user_cooldown_over(event.key, now)
        if event.name != "cooldown" or self.blacklist is None or self.blacklist.until is None:
            return []
        if not self.blacklist.expire(now.mono):
            return [do.SetTimer("cooldown", self.blacklist.until)]
        return [
            do.Say(
                "info", "node %s: its blacklisting cooldown is over", None, (self.settings.node,)
            ),
            *self._readmit(now),
        ]

    def _readmit(self, now: ev.Now) -> Instructions:
        self.blacklisted_until = 0.0
        return [
            do.ClearTimer("cooldown"),
            do.Count("blacklisted", value=0),
            *self._hold(Hold.BLACKLISTED, False, now),
        ]

    # -- nodes lost, leaving, shutting down --------------------------------------------------------

    def _nodes_lost(self, event: ev.NodesLost, now: ev.Now) -> Instructions:
        """Every part here re-forms without the lost nodes; and a job they made full has
        room again for this node (a hot spare waiting beside it)."""
        out: Instructions = []
        for part in list(self.parts.values()):
            out += self._tell(part, event, now)
        for record in self.jobs.values():
            for node in event.nodes:
                said = record.parts.get(node)
                if record.outcome is None and said is not None and said.state.active:
                    self.lost_parts[(record.id, node)] = said
        return out + self._offer_self(now)

    def _leave_asked(self, event: ev.LeaveAsked, now: ev.Now) -> Instructions:
        parts = (
            [self.parts[event.job]]
            if event.job in self.parts
            else []
            if event.job is not None
            else list(self.parts.values())
        )
        out: Instructions = []
        for part in parts:
            out += self._tell(part, ev.Leaving(part.job, event.reason), now)
        return out

    def _shutdown(self, event: ev.ShutdownAsked, now: ev.Now) -> Instructions:
        """A one-node cluster cancels its jobs, those that wait too (its store dies with it); a
        node of a larger one leaves its jobs (they go on elsewhere)."""
        self.stopping = True
        out: Instructions = []
        if event.standalone:
            for record in list(self.jobs.values()):
                if record.outcome is None and record.id not in self.finishing:
                    outcome = Outcome(
                        JobState.CANCELLED,
                        now.wall,
                        None,
                        "cancelled: elasticd shut down",
                        None,
                        self.settings.node,
                    )
                    out += self._finish(record.id, outcome, record.spec)
            return out
        for part in list(self.parts.values()):
            out += self._tell(part, ev.Leaving(part.job, Reason.SHUTDOWN), now)
        return out

    # -- what the shell and the node record read ----------------------------------------------

    def used(self) -> Resources:
        """What the parts here hold."""
        return Resources(
            sum(o.slots for o in self.offers.values()),
            tuple(g for o in self.offers.values() for g in o.gpus),
        )

    def local_jobs(self) -> list[str]:
        return sorted(self.parts)

    def job_story(self, job: str) -> list[str]:
        """The story of this node's part of ``job`` (of the last part, once it ended)."""
        part = self.parts.get(job)
        story = part.story if part is not None else self.stories.get(job)
        return story.lines() if story is not None else []

    def node_story(self) -> list[str]:
        """The node's own story: holds, placement, the schedule, GPU health, lost nodes."""
        return self.story.lines()


def _started(record: JobRecord) -> float | None:
    times = [p.started for p in record.parts.values() if p.started]
    return min(times) if times else None


class NodePhase(enum.StrEnum):
    SERVING = "serving"
    STOPPING = "stopping"  # shutting down: no new part; the parts end


NodeHandler = Callable[[NodeCore, Any, ev.Now], Instructions]

_ALWAYS: dict[type, NodeHandler] = {
    ev.PartClosed: NodeCore._part_closed,
    ev.PartStartFailed: NodeCore._part_start_failed,
    ev.Finished: NodeCore._finished,
    ev.OpFailed: NodeCore._op_failed,
    ev.NodesLost: NodeCore._nodes_lost,
    ev.NodeTimerFired: NodeCore._node_timer,
    ev.JobsChanged: NodeCore._jobs_changed,
    ev.LeaveAsked: NodeCore._leave_asked,
    ev.ScheduleChanged: NodeCore._schedule_changed,
    ev.GpusRead: NodeCore._gpus_read,
    ev.GpuReadmitted: NodeCore._gpu_readmitted,
    ev.SparesShed: NodeCore._spares_shed,
}
NODE_EVENTS: EventTable[NodePhase, NodeHandler] = EventTable(
    "a node",
    {
        NodePhase.SERVING: {
            **_ALWAYS,
            ev.Restored: NodeCore._restored,
            ev.HoldChanged: NodeCore._hold_changed,
            ev.Listed: NodeCore._listed,
            ev.CancelAsked: NodeCore._cancel,
            ev.ShutdownAsked: NodeCore._shutdown,
        },
        NodePhase.STOPPING: {
            **_ALWAYS,
            ev.HoldChanged: NodeCore._hold_changed,
            ev.Listed: NodeCore._listed,
            ev.CancelAsked: NodeCore._cancel,
            ev.ShutdownAsked: lambda node, event, now: [],
        },
    },
)
