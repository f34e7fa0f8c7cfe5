"""The rendezvous executor: applies the pure decisions of :mod:`elasticd.rendezvous.ops` to
the store.

Keys: :mod:`elasticd.rendezvous.keys`.  Every record is signed for its key
(store/signing.py); the unsigned ``rev`` keys only wake waiters, who read the signed state
and back off if it did not change (anyone can end a wait: write its key, or on TCPStore
read it while it is missing; ``aio.BackOff``, doubling up to a keep-alive interval, reset
by news), and the unsigned counter only says how far to read the log.  A state that does
not open, or is older than the newest this node saw before it asked (a read that crossed a
newer one of its own is not), is refused and counted, and the newest state this node saw
is written back over it (as after a store reset).  A state
is opened once per change (``state.Decoded``, which the handlers of a process may share).
The join log: :mod:`elasticd.rendezvous.joinlog`.

One executor, ``_execute`` (torchelastic's _DistributedRendezvousOpExecutor): read the state
and the open round's join log, decide with a pure function of ``ops``, act (compare-and-set
the decided state, write an entry of the join log, or wait for the next revision) until the
decision is an outcome.  A state that vanished (the store host restarted and lost its data)
is restored first, as an action of its own: RESTORE writes back the newest state this node
saw, compare-and-set against "missing" (or against the refused bytes), so that the first
such write wins and every node converges on it.  A node that never saw the state of a job
that already ran does not start a new one (``may_create``): that would run a job again
whose state was deleted.  Heartbeat counters and join logs are recreated as the nodes go on.

The keeper (``keep``, a task its owner runs) beats this node's heartbeat, reads the counters
of its two neighbours on a ring of the nodes involved (``ops.ring_watch``: O(1) per node)
with the signed head (the state only when it moved: :mod:`elasticd.rendezvous.head`), drops
the silent ones through the executor, and resolves ``watch()`` futures: while a round is
watched it follows every revision (a wait for ``rev/<v+1>`` until its next duty), otherwise
it sleeps until its next duty.  Nobody polls.  Everything runs on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from elasticd.aio import BackOff, back_off, race
from elasticd.core.checkpoints import Holding
from elasticd.core.liveness import Beat
from elasticd.errors import (
    AddInDoubt,
    NotACounter,
    RendezvousClosedError,
    RendezvousGone,
    RendezvousStateError,
    RendezvousTimeoutError,
    StoreError,
)
from elasticd.faults import Faults, Throttle, held_back
from elasticd.journal import about
from elasticd.rendezvous.head import beat_counts, head_version, seal_head, state_moved
from elasticd.rendezvous.joinlog import JoinLog, OwnEntry
from elasticd.rendezvous.keys import Keys
from elasticd.rendezvous.ops import (
    Act,
    Action,
    View,
    claim,
    decide_close,
    decide_join,
    decide_leave,
    decide_liveness,
    decide_next_round,
    decide_restore,
    ends_joining,
    info_for,
    observe_beats,
    ring_around,
    ring_of,
    ring_watch,
    round_event,
    timeout_message,
    track_last_call,
    watched,
)
from elasticd.rendezvous.state import (
    Announcement,
    Decoded,
    NextRound,
    Participant,
    Reason,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousState,
    RoundEvent,
    decode,
    encode,
)
from elasticd.store.base import Store, counter_value
from elasticd.store.signing import (
    Freshness,
    Refused,
    Signer,
    VersionClock,
    open_or_refuse,
    open_version,
)

log = logging.getLogger(__name__)

REV_KEEP = 32  # revision keys kept behind the newest one
SWEEP = 64  # stale keys deleted at once, at most

_NEXT_ROUND = {
    Act.OPEN_ROUND: NextRound.OPENED,
    Act.ALREADY: NextRound.ALREADY,
    Act.EXHAUSTED: NextRound.EXHAUSTED,
    Act.CLOSED: NextRound.CLOSED,
}
# Outcomes that may come with a state to write first (leaving the round on a join timeout).
_FINAL = frozenset({Act.DONE, Act.NOTHING, Act.CLOSED, Act.TIMED_OUT, Act.ALREADY, Act.EXHAUSTED})

Decide = Callable[[RendezvousState, View, float], Action]  # (state, join-log view, now)
Write = Callable[[Store], Awaitable[object]]  # a write to make before a read of the state


@dataclass(frozen=True)
class _Snapshot:
    state: RendezvousState
    raw: bytes | None  # the sealed bytes in the store; None: there is no state (yet, or any more)
    valid: bool = True  # False: the bytes were refused (the state is read as missing)

    @property
    def missing(self) -> bool:
        """No state this node may act on: none in the store, or a refused one."""
        return self.raw is None or not self.valid


@dataclass(frozen=True)
class _Watch:
    round: int
    waiting: bool
    future: asyncio.Future[RoundEvent]


class RendezvousHandler:
    """One node's handle on one job's rendezvous (torchelastic's DynamicRendezvousHandler,
    event-driven and with stable ranks).  Its coroutines run on one event loop.  ``faults``:
    the daemon's, where an unexpected error of the keeper is counted (loop
    ``rendezvous_keeper``) and logged with its traceback once per interval; what the keeper
    expects (the store failing, the job's state gone) is a warning once per interval."""

    def __init__(
        self,
        store: Store,
        signer: Signer,
        settings: RendezvousSettings,
        node: str,
        addr: str,
        *,
        prefix: str,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Refused | None = None,
        may_create: bool = True,
        faults: Faults | None = None,
        on_lost: Callable[[tuple[str, ...]], None] = lambda nodes: None,
        decoded: Decoded | None = None,
    ) -> None:
        self._store, self._signer, self._settings = store, signer, settings
        self._decoded = (
            decoded or Decoded()
        )  # states opened: may be shared by the handlers of a process
        self._logger = logging.LoggerAdapter(
            log, about(settings.run_id)
        )  # its records concern the job
        self._may_create = may_create  # False: the job ran; never start a fresh state for it
        self._on_lost = (
            on_lost  # silent members this node dropped: the node's one word that they are gone
        )
        self._beat_versions = VersionClock()
        self._fresh = Freshness()  # heartbeats: an older beat written back is no beat
        self.node, self.addr = node, addr
        self._keys = Keys(prefix)
        self._clock = clock
        self._refused = on_refused or _log_refused
        self._log = JoinLog(signer, self._keys, self._refused, settings)
        self._newest = _Snapshot(RendezvousState(), None)  # the newest state this node saw
        self._stale: list[str] = []  # keys nobody reads any more: the sweeper deletes them
        self._swept = asyncio.Event()  # set when keys were added to _stale
        self._watches: list[_Watch] = []
        self._others: set[str] = set()  # the keeper's neighbours on the ring, as of its last duty
        self._duties = 0
        self._watched = asyncio.Event()  # set by a new watch(): the keeper follows revisions
        self._left = False
        self._shut = False
        self._faults = (
            faults or Faults()
        )  # the keeper's unexpected errors: counted, logged once per interval
        self._told = Throttle()  # the keeper's expected troubles, once per interval each
        self._quiet = BackOff(longest=settings.keep_alive_interval)  # waits that woke for naught

    @property
    def settings(self) -> RendezvousSettings:
        return self._settings

    # -- joining ---------------------------------------------------------------------------

    async def next_rendezvous(
        self,
        nproc: int,
        master_port: int,
        scheduled: Iterable[str] = (),
        holds: Holding | None = None,
    ) -> RendezvousInfo:
        """Join the current round (or the next one) and return once a round that includes this
        node is complete.  To leave a complete round for the next one, first call
        :meth:`request_next_round`; calling this again in a complete round that includes this
        node returns that round again.  ``scheduled``: the nodes the cluster's schedule gives
        the job; a round that holds them all closes at once, with no last call.  ``holds``:
        what this node holds of the job's state (its ranks go where it moves the least)."""
        self._check_running()
        view = View(
            record=Participant(self.addr, nproc, master_port, holds),
            deadline=self._clock() + self._settings.join_timeout,
            scheduled=frozenset(scheduled),
        )

        def step(state: RendezvousState, logged: View, now: float) -> Action:
            nonlocal view
            self._check_running()
            view = track_last_call(
                state,
                self._settings,
                replace(
                    view, announced=logged.announced, log_end=logged.log_end, pending=logged.pending
                ),
                now,
            )
            return decide_join(state, self.node, self._settings, view, now)

        # observers find a counter first
        snap, action = await self._execute(step, until_outcome=True, first=self._beat)
        if action.act is Act.DONE:
            return info_for(
                snap.state, self.node, self._settings.run_id, self._decoded.members(snap.state)
            )
        if action.act is Act.CLOSED:
            raise RendezvousClosedError(f"rendezvous '{self._settings.run_id}' is closed")
        raise RendezvousTimeoutError(timeout_message(snap.state, self.node, self._settings, view))

    def _check_running(self) -> None:
        if self._shut:
            raise RendezvousClosedError(f"the rendezvous handler of {self.node} was shut down")
        if self._left:
            raise RendezvousClosedError(f"{self.node} left rendezvous '{self._settings.run_id}'")

    # -- rounds ----------------------------------------------------------------------------

    async def request_next_round(
        self, round: int | None, reason: Reason, lost: Iterable[str] = ()
    ) -> NextRound:
        """Supersede ``round`` (once, whoever asks first; None: the current round, if it is
        complete).  FAILURE uses one restart of the job-wide budget: EXHAUSTED, and no new
        round, when none is left.  The new round completes without waiting for the ``lost``
        members (known dead by the caller)."""
        reason = Reason(reason)  # ValueError for an unknown one
        if reason is Reason.INITIAL:
            raise ValueError("the initial round is not requested: it is the first")
        lost = tuple(lost)
        _, action = await self._execute(
            lambda state, view, now: decide_next_round(state, round, reason, self._settings, lost)
        )
        if action.act is Act.OPEN_ROUND:
            assert action.state is not None
            self._logger.info(
                "rendezvous %s: %s opened round %d (%s)",
                self._settings.run_id,
                self.node,
                action.state.round,
                reason,
            )
        return _NEXT_ROUND[action.act]

    async def leave(self, reason: Reason = Reason.DRAIN) -> None:
        """Leave for good; a complete round that had this node is superseded with ``reason``."""
        self._left = True
        await self._execute(
            lambda state, view, now: decide_leave(state, self.node, Reason(reason), view)
        )

    async def set_closed(self) -> None:
        await self._execute(lambda state, view, now: decide_close(state))

    def watch(self, round: int, *, waiting: bool = True) -> asyncio.Future[RoundEvent]:
        """A future that resolves when ``round`` is superseded, the rendezvous is closed, or
        (with ``waiting``) nodes are waiting to join.  The keeper resolves it."""
        future: asyncio.Future[RoundEvent] = asyncio.get_running_loop().create_future()
        if self._shut:
            future.cancel()
            return future
        self._watches.append(_Watch(round, waiting, future))
        self._resolve_watches(self._newest.state)
        self._watched.set()  # the keeper now follows every revision
        return future

    # -- exit barrier ----------------------------------------------------------------------

    async def exit_barrier_arrive(self, info: RendezvousInfo) -> None:
        """This node's workers all succeeded in ``info.round`` (idempotent)."""
        key = self._keys.exit_arrived(info.round, self.node)
        await self._store.set(key, self._signer.seal(key, {"node": self.node}))

    async def exit_barrier_wait(
        self,
        info: RendezvousInfo,
        timeout: float,
        progress: Callable[[int, int], None] = lambda done, total: None,
    ) -> bool:
        """True once every member of ``info.round`` that holds workers arrived (one with none
        has nothing to finish), False after ``timeout`` seconds.
        ``progress(done, total)`` hears of each arrival while it waits (it waits on the key of
        a member still missing, never on a timer; a forged key there costs a back-off)."""
        deadline = self._clock() + timeout
        total = info.group_world_size
        quiet = BackOff(longest=self._settings.keep_alive_interval)
        awaited, before = None, -1
        while True:
            arrived = await self._arrivals(info)
            missing = [m.node for m in info.members if m.nproc and m.node not in arrived]
            if not missing:
                return True
            progress(len(arrived), total)
            left = deadline - self._clock()
            if left <= 0:
                return False
            if len(arrived) > before:
                quiet.reset()
            elif awaited in missing:  # its wait ended, yet no arrival of it opens: no news
                await quiet.pause(left)
            before, awaited = len(arrived), missing[0]
            if not await self._store.wait_for(self._keys.exit_arrived(info.round, awaited), left):
                awaited = None

    async def exit_barrier_progress(self, info: RendezvousInfo) -> tuple[int, int]:
        return len(await self._arrivals(info)), info.group_world_size

    async def _arrivals(self, info: RendezvousInfo) -> set[str]:
        """The members of ``info.round`` whose signed arrival is in the store."""
        keys = [self._keys.exit_arrived(info.round, m.node) for m in info.members]
        values = await self._store.get_many(keys)
        return {
            m.node
            for m, key, raw in zip(info.members, keys, values)
            if open_or_refuse(
                self._signer,
                key,
                raw,
                functools.partial(_arrival_of, m.node),
                self._refused,
            )
        }

    # -- lifecycle -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Cancel pending watches; later joins fail.  Does not leave the rendezvous (its owner
        stops the keeper task)."""
        self._shut = True
        watches, self._watches = self._watches, []
        for w in watches:
            w.future.cancel()

    # -- the keeper ------------------------------------------------------------------------

    async def keep(self) -> None:
        """Heartbeats, liveness and watches, until cancelled; beside them (never in the way
        of a heartbeat), the deletion of keys nobody reads any more."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._sweeper())
            await self._keep()

    async def _keep(self) -> None:
        beats: dict[str, Beat] = {}
        due = self._clock()
        while True:
            try:
                if self._clock() >= due:
                    due = self._clock() + self._settings.keep_alive_interval
                    beats = await self._tick(beats)
                self._resolve_watches(self._newest.state)
                await self._idle(due)
            except (
                RendezvousGone,
                RendezvousStateError,
            ) as err:  # the state is gone, refused or unusable
                self._fail_watches(err)
                self._tell(type(err).__name__, "rendezvous %s: %s", self._settings.run_id, err)
                await back_off(self._settings.keep_alive_interval)
            except StoreError as err:
                self._tell(
                    "store",
                    "rendezvous %s: store error in the keeper of %s: %s",
                    self._settings.run_id,
                    self.node,
                    err,
                )
                await back_off(self._settings.keep_alive_interval)
            except Exception as err:  # a bug must not silence this node's heartbeat for good
                self._faults.report("rendezvous_keeper", f"job {self._settings.run_id}")
                self._fail_watches(err)
                await back_off(self._settings.keep_alive_interval)

    def _tell(self, kind: str, message: str, *args: object) -> None:
        """A warning of the keeper's: what it meets at every duty is told once per interval."""
        held = self._told.check(kind, self._clock())
        if held is not None:
            self._logger.warning(message + "%s", *args, held_back(held))

    async def _idle(self, due: float) -> None:
        """Until the next duty: follow every state revision while someone watches; otherwise
        wait for a new watch()."""
        self._watched.clear()
        left = max(due - self._clock(), 0.0)
        if self._watches:
            newest = self._newest
            await self._awaited([self._keys.rev(newest.state.version + 1)], newest, left)
            return
        try:
            async with asyncio.timeout(left):  # not wait_for: see elasticd.aio
                await self._watched.wait()
        except TimeoutError:
            pass

    async def _tick(self, beats: dict[str, Beat]) -> dict[str, Beat]:
        """Heartbeat; read the counters of this node's neighbours on the ring of every node
        the state and its join log involve (a logged joiner too); drop the silent ones."""
        others = sorted(self._others)  # the ring of the state seen at the last duty
        seen, values = await self._duty_read(others)
        counts = beat_counts(
            self._signer,
            {n: self._keys.heartbeat(n) for n in others},
            values,
            beats,
            self._refused,
            self._fresh,
        )
        self._others = self._ring(*seen)
        now = self._clock()
        beats = observe_beats(beats, counts, now)
        _snap, action = await self._execute(
            lambda state, view, _: decide_liveness(
                state, self.node, self._settings, replace(view, beats=beats), now
            ),
            seen=seen,
        )
        if action.state is not None and action.act in (Act.OPEN_ROUND, Act.REMOVE):
            silent = sorted(set(others) - watched(action.state, View()))
            self._on_lost(tuple(silent))
            self._logger.warning(
                "rendezvous %s: %s dropped silent node(s) %s (%s, round %d)",
                self._settings.run_id,
                self.node,
                ", ".join(silent),
                action.act.value,
                action.state.round,
            )
        return beats

    def _ring(self, snap: _Snapshot, view: View) -> set[str]:
        """This node's neighbours on the ring (``ops.ring_watch``): of the state's ring, built
        once per state, unless the join log names nodes beyond it."""
        ring, names = self._decoded.built(snap.state, ring_of)
        if any(a.node not in names for a in view.announced):
            return ring_watch(watched(snap.state, view), self.node)
        return ring_around(ring, self.node)

    async def _sweeper(self) -> None:
        """Delete the stale keys, a batch at a time, as they come (a key it fails to delete
        stays behind: it is never read again).  Every delete of a batch ends before the
        next: a failed one is logged, and a cancellation always ends the sweeper (see
        elasticd.aio: the first error of a plain gather can stand in for it)."""
        while True:
            await self._swept.wait()
            self._swept.clear()
            while self._stale:
                batch, self._stale = self._stale[:SWEEP], self._stale[SWEEP:]
                results = await asyncio.gather(
                    *(self._store.delete(key) for key in batch), return_exceptions=True
                )
                failed = [r for r in results if isinstance(r, Exception)]
                if failed:  # best effort: the heartbeat beside it must go on
                    log.warning(
                        "rendezvous %s: %s could not delete %d stale key(s): %s",
                        self._settings.run_id,
                        self.node,
                        len(failed),
                        failed[0],
                    )

    def _sweep(self, keys: Iterable[str]) -> None:
        self._stale.extend(keys)
        self._swept.set()

    async def _beat(self, store: Store) -> None:
        """This node's heartbeat: a signed record whose version goes up."""
        key = self._keys.heartbeat(self.node)
        await store.set(key, self._signer.seal(key, {}, version=self._beat_versions.next()))

    async def _duty_read(
        self, nodes: list[str]
    ) -> tuple[tuple[_Snapshot, View], list[bytes | None]]:
        """A duty's reads after its beat: the head, the open round's counter and the heartbeats
        of ``nodes`` in one batch; the state only when ``head.state_moved`` says so (then the
        state and the counter, as :meth:`_observe`).  Never a revision key: TCPStore's read of
        a missing key wakes those who wait for it."""
        await self._beat(self._store)
        keys, newest = self._keys, self._newest
        counted = not (newest.state.complete or newest.state.closed)
        values = await self._store.get_many(
            [
                keys.head,
                *(keys.heartbeat(n) for n in nodes),
                *([keys.joins(newest.state.round)] if counted else []),
            ]
        )
        self._duties += 1
        head = head_version(self._signer, keys.head, values[0], self._refused)
        beats = values[1 : 1 + len(nodes)]
        if state_moved(None if newest.missing else newest.state.version, head, self._duties):
            return await self._observe(), beats
        return (
            newest,
            await self._logged(newest.state, _held(values[-1]) if counted else None),
        ), beats

    def _resolve_watches(self, state: RendezvousState) -> None:
        """Settle the watches that ``state`` answers."""
        kept = []
        for w in self._watches:
            event = round_event(state, w.round, self._settings, waiting=w.waiting)
            if w.future.done():
                continue
            if event is None:
                kept.append(w)
            else:
                w.future.set_result(event)
        self._watches = kept

    def _fail_watches(self, err: Exception) -> None:
        watches, self._watches = self._watches, []
        for w in watches:
            if not w.future.done():
                w.future.set_exception(err)

    # -- the executor ----------------------------------------------------------------------

    async def _execute(
        self,
        decide: Decide,
        *,
        until_outcome: bool = False,
        first: Write | None = None,
        seen: tuple[_Snapshot, View] | None = None,
    ) -> tuple[_Snapshot, Action]:
        """Read, decide, act until the decision is an outcome (with ``until_outcome``) or a
        decided state was written (without).  ``first``: a write to make before the first
        read; ``seen``: that first read, made by the caller.  Each act writes, then reads the
        state and the join log again (a lost compare-and-set returns the state that won)."""
        snap, logged = seen or await self._observe(first)
        while True:
            if snap.missing:
                restore = decide_restore(self._newest.state, self.node)
                if restore.act is Act.RESTORE:
                    assert restore.state is not None  # the state to write back
                    why = "vanished" if snap.raw is None else "was refused"
                    (snap, logged), won = await self._write(snap, restore.state)
                    if won:  # anyone may delete it as often as they like: told once per interval
                        self._tell(
                            "restored",
                            "rendezvous %s: the state %s; %s restored round %d",
                            self._settings.run_id,
                            why,
                            self.node,
                            restore.state.round,
                        )
                    continue
                if not self._may_create:
                    raise RendezvousGone(
                        f"rendezvous '{self._settings.run_id}': the job ran before and its state is "
                        f"gone or refused; {self.node} does not start it again"
                    )
            action = decide(snap.state, logged, self._clock())
            if action.state is not None and not logged.whole:
                logged = await self._logged(
                    snap.state, full=True
                )  # a write folds the log: read it first
                continue
            if action.state is not None:
                (snap, logged), won = await self._write(snap, action.state)
                if won and (action.act in _FINAL or not until_outcome):
                    return snap, action
            elif action.act is Act.ANNOUNCE:
                assert action.record is not None, "an announcement carries the joiner's record"
                await self._announce(snap.state, action.record, logged)
                snap, logged = await self._observe()
            elif action.act is Act.WAIT:
                # a hole's writer is on its way; the revision too: the round may have been
                # folded and its entries swept before this wait begins (the hole may be this
                # node's own entry, read after the sweep), and nobody writes them again
                keys = [self._keys.rev(snap.state.version + 1)]
                hole = self._log.hole()
                if hole is not None:
                    keys.append(self._keys.join(snap.state.round, hole))
                snap, logged = await self._awaited(keys, snap, action.until - self._clock(), logged)
            else:
                return snap, action

    async def _announce(self, state: RendezvousState, record: Participant, logged: View) -> None:
        """Write this node's entry in the open round's join log, under a number taken from the
        counter; or, when the counter is not a count (read so, or met so by the add) or the
        entry written last stayed out of reach, under one read as missing (and the stranded
        one is deleted).  Written once
        (compare-and-set): a number that is taken already is given up (the next step
        announces again).  An add in doubt is made again (a number taken twice leaves a hole,
        which readers read past)."""
        joins, round, mine = self._log, state.round, Announcement(self.node, record)
        stranded = joins.mine if logged.pending is not None else None
        number = claim(joins.missing, joins.top, self.node)
        if joins.count is not None and not stranded:
            counter = self._keys.joins(round)
            try:
                try:
                    number = await self._store.add(counter, 1)
                except AddInDoubt:  # applied or not: a number taken again leaves a hole
                    number = await self._store.add(counter, 1)
            except NotACounter:  # junk since it was read: the claimed number stands
                pass
        key, sealed = joins.entry(round, number, mine)
        if not (await self._store.compare_set(key, None, sealed))[0]:
            return
        if stranded and (stranded.round, stranded.number) != (round, number):
            self._sweep([self._keys.join(stranded.round, stranded.number)])
        joins.mine = OwnEntry(round, number, self._clock(), mine)

    async def _observe(self, first: Write | None = None) -> tuple[_Snapshot, View]:
        """The state and the join log of its open round (the counter of the round this node
        saw last is read with the state, in one round trip), after the write ``first``."""
        guess = self._newest.state
        if first is not None:
            await first(self._store)
        counted = not (guess.complete or guess.closed)
        keys = [self._keys.state] + ([self._keys.joins(guess.round)] if counted else [])
        raw, *count = await self._store.get_many(keys)
        snap = self._snapshot(raw, guess.version)
        same = counted and snap.state.round == guess.round
        return snap, await self._logged(snap.state, _held(count[0]) if same else None)

    async def _logged(
        self, state: RendezvousState, count: bytes | None = None, full: bool = False
    ) -> View:
        """The open round's join-log records that the state has not folded yet, reading what
        is new (``count``: its counter as read; None: read it now)."""
        if state.complete or state.closed:
            return View()
        if count is None:
            count = _held(await self._store.get(self._keys.joins(state.round)))
        await self._log.fetch(self._store, state, counter_value(count), self._clock(), full)
        return self._log.view(state)

    def _snapshot(self, raw: bytes | None, known: int) -> _Snapshot:
        """The state read as ``raw`` by a read made when this node knew version ``known``.
        A read that crossed a newer state of this node's own reads as that newer state."""
        if raw is None:
            return _Snapshot(RendezvousState(), None)
        if raw == self._newest.raw:  # the same sealed bytes: checked and decoded already
            return self._newest
        state = self._open(raw, known)
        if state is None:
            return _Snapshot(RendezvousState(), raw, valid=False)
        if state.version < self._newest.state.version:
            return self._newest
        return self._remember(_Snapshot(state, raw))

    async def _write(
        self, snap: _Snapshot, new: RendezvousState
    ) -> tuple[tuple[_Snapshot, View], bool]:
        """Compare-and-set ``new`` over ``snap``; then the state and its join log as after
        :meth:`_observe`, and whether this write won.  The winner marks the revision and
        deletes what nobody will wait on or read again."""
        new = replace(new, nonce=secrets.token_hex(8))
        keys, store, known = self._keys, self._store, self._newest.state.version
        sealed = self._signer.seal(keys.state, encode(new), version=new.version)
        won, current = await store.compare_set(keys.state, snap.raw, sealed)
        if won:
            await store.set(keys.rev(new.version), b"1")
            await store.set(keys.head, seal_head(self._signer, keys.head, new))
            if new.version > REV_KEEP:
                await store.delete(keys.rev(new.version - REV_KEEP))
            if snap.valid and ends_joining(snap.state, new):
                round = new.round
                self._sweep(
                    [
                        keys.joins(round),
                        *(keys.join(round, n) for n in self._log.known(round, new.folded)),
                    ]
                )
        after = self._remember(_Snapshot(new, sealed)) if won else self._snapshot(current, known)
        return (after, await self._logged(after.state)), won

    async def _awaited(
        self, keys: list[str], snap: _Snapshot, timeout: float, logged: View | None = None
    ) -> tuple[_Snapshot, View]:
        """The state and its join log once one of ``keys`` is written (the next revision's,
        a join-log entry's), or after ``timeout`` seconds.  News is a new state that opens,
        or (given the join log as ``logged``) a new entry in the log.  A wake without news
        (anyone can write the key, or on TCPStore read it while it is missing; a refused
        state is restored by the next act) pauses this handler before it reads again:
        ``_quiet``, doubling up to a keep-alive interval, reset by news."""
        if timeout <= 0:
            return await self._observe()
        ends = self._clock() + timeout
        waits = {key: self._store.wait_for(key, min(timeout, _LONGEST_WAIT)) for key in keys}
        _, first = await race(**waits)
        woke = first.result()
        after = await self._observe()
        news = (after[0].valid and after[0].raw != snap.raw) or (
            logged is not None and after[1].announced != logged.announced
        )
        if not woke or news:
            if news:
                self._quiet.reset()
            return after
        await self._quiet.pause(ends - self._clock())
        return await self._observe()

    def _open(self, raw: bytes, known: int) -> RendezvousState | None:
        """The state in ``raw``; None (refused and counted) if it does not open for this
        key, or is older than ``known``, the newest this node saw before it read (a state
        written back: the store held a newer one before)."""
        key = self._keys.state
        state = self._decoded.get(self._signer, key, raw)
        if state is None:
            opened = open_version(self._signer, key, raw, self._refused)
            if opened is None:
                return None
            try:
                state = decode(opened.body)
            except RendezvousStateError as exc:
                self._refused(key, f"unreadable: {exc}")
                return None
            if state.version != opened.version:
                self._refused(key, f"state version {state.version} is sealed as {opened.version}")
                return None
            self._decoded.put(self._signer, key, raw, state)
        if state.version < known:
            self._refused(
                key,
                f"state version {state.version} is older than version {known} "
                "seen before (written back)",
            )
            return None
        return state

    def _remember(self, snap: _Snapshot) -> _Snapshot:
        if snap.state.version >= self._newest.state.version:
            self._newest = snap
        return snap


_LONGEST_WAIT = 3600.0  # a wait with no deadline of its own still returns now and then


def _log_refused(key: str, why: str) -> None:
    log.error("refused store record %s: %s", key, why)


def _arrival_of(node: str, body: Any) -> bool | None:
    """An exit arrival record's body: True if it is ``node``'s."""
    return body["node"] == node or None


def _held(raw: bytes | None) -> bytes:
    """What a counter key holds: a missing one counts 0 (an empty one is no count)."""
    return b"0" if raw is None else raw
