"""The rendezvous executor: applies the pure decisions of :mod:`elasticd.rendezvous.ops` to
the store.

Keys, all under the handler's ``prefix``::

    state                   the signed RendezvousState (compare-and-set only)
    rev/<v>                 set when version v was written; waiters block on the next one
    hb/<node>               heartbeat counter
    round/<r>/joins         the round's join log: signed records, one per line (append only)
    round/<r>/exit/...      the exit barrier of round r
    round/<r>/job/          handed to the job as RendezvousInfo.store_prefix

Threads: ``next_rendezvous``, ``request_next_round``, ``leave`` and ``set_closed`` run in the
caller's thread. One background thread per handler, the *keeper*, bumps this node's
heartbeat, watches the other nodes' counters, drops the silent ones and resolves
``watch()`` futures. Nobody sleeps between syncs: a thread that holds version v blocks in
``wait_for("rev/<v+1>")`` with a timeout equal to its next duty (the keeper does so only
while someone watches a round; otherwise it sleeps until its next heartbeat).

If the state key vanishes (the store host restarted and lost its data), a node of the
rendezvous writes back the newest state it saw (compare-and-set against "missing"); the
first such write wins and every node converges on it. Heartbeat counters and join logs are
recreated as the nodes go on.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, replace

from elasticd.errors import (
    RendezvousClosedError,
    RendezvousStateError,
    RendezvousTimeoutError,
    StoreError,
)
from elasticd.rendezvous.ops import (
    Act,
    Action,
    Beat,
    View,
    decide_close,
    decide_join,
    decide_leave,
    decide_liveness,
    decide_next_round,
    decide_restore,
    info_for,
    joined,
    num_waiting,
    observe_beats,
    round_event,
    track_last_call,
    watched,
)
from elasticd.rendezvous.state import (
    Reason,
    Announcement,
    NextRound,
    Participant,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousState,
    RoundEvent,
    decode,
    decode_announcement,
    encode,
    encode_announcement,
)
from elasticd.store.base import StoreBackend
from elasticd.store.signing import Refused, Signer, open_or_refuse

log = logging.getLogger(__name__)

REV_KEEP = 32  # revision keys kept behind the newest one

_NEXT_ROUND = {
    Act.OPEN_ROUND: NextRound.OPENED,
    Act.ALREADY: NextRound.ALREADY,
    Act.EXHAUSTED: NextRound.EXHAUSTED,
    Act.CLOSED: NextRound.CLOSED,
}


class Keys:
    """The store keys of one rendezvous."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.rstrip("/")
        self.state = f"{self.prefix}/state"

    def rev(self, version: int) -> str:
        return f"{self.prefix}/rev/{version}"

    def heartbeat(self, node: str) -> str:
        return f"{self.prefix}/hb/{node}"

    def joins(self, round: int) -> str:
        return f"{self.prefix}/round/{round}/joins"

    def job(self, round: int) -> str:
        return f"{self.prefix}/round/{round}/job/"

    def exit_arrived(self, round: int, node: str) -> str:
        return f"{self.prefix}/round/{round}/exit/arrived/{node}"

    def exit_count(self, round: int) -> str:
        return f"{self.prefix}/round/{round}/exit/count"

    def exit_done(self, round: int) -> str:
        return f"{self.prefix}/round/{round}/exit/done"


@dataclass(frozen=True)
class _Snapshot:
    state: RendezvousState
    raw: bytes | None  # the sealed bytes in the store; None: there is no state yet


@dataclass(frozen=True)
class _Watch:
    round: int
    waiting: bool
    future: Future


class _JoinLog:
    """Reads a round's join log, parsing only the records appended since the last read.

    A record that fails its MAC is refused (reported, and treated as absent), not fatal.
    """

    def __init__(self, store: StoreBackend, signer: Signer, keys: Keys, refused: Refused) -> None:
        self._store, self._signer, self._keys, self._refused = store, signer, keys, refused
        self._lock = threading.Lock()
        self._round, self._raw, self._records = -1, b"", []

    def read(self, round: int) -> list[Announcement | None]:
        raw = self._store.get(self._keys.joins(round)) or b""
        with self._lock:
            if round != self._round or not raw.startswith(self._raw):
                self._round, self._raw, self._records = round, b"", []
            tail = raw[len(self._raw) : raw.rfind(b"\n") + 1]
            self._records.extend(self._parse(line) for line in tail.splitlines())
            self._raw += tail
            return list(self._records)

    def append(self, round: int, announcement: Announcement) -> None:
        line = self._signer.seal(encode_announcement(announcement)) + b"\n"
        self._store.append(self._keys.joins(round), line)

    def _parse(self, line: bytes) -> Announcement | None:
        return open_or_refuse(self._signer, self._keys.joins(self._round), line,
                              decode_announcement, self._refused)


class RendezvousHandler:
    """One node's handle on one job's rendezvous (torchelastic's DynamicRendezvousHandler,
    event-driven and with stable ranks). Safe to call from several threads."""

    def __init__(
        self,
        store: StoreBackend,
        signer: Signer,
        settings: RendezvousSettings,
        node: str,
        addr: str,
        *,
        prefix: str,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Refused | None = None,
    ) -> None:
        self._store, self._signer, self._settings = store, signer, settings
        self.node, self.addr = node, addr
        self._keys = Keys(prefix)
        self._clock = clock
        self._refused = on_refused or _log_refused
        self._log = _JoinLog(store, signer, self._keys, self._refused)
        self._lock = threading.Lock()
        self._newest = _Snapshot(RendezvousState(), None)  # the newest state any of our threads saw
        self._watches: list[_Watch] = []
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by shutdown() and by a new watch()
        self._left = False
        self._keeper: threading.Thread | None = None

    @property
    def settings(self) -> RendezvousSettings:
        return self._settings

    # -- joining ---------------------------------------------------------------------------

    def next_rendezvous(self, nproc: int, master_port: int) -> RendezvousInfo:
        """Join the current round (or the next one) and return once a round that includes this
        node is complete. To leave a complete round for the next one, first call
        :meth:`request_next_round`; calling this again in a complete round that includes this
        node returns that round again."""
        self.start()
        self._store.add(self._keys.heartbeat(self.node), 1)  # observers find a counter first
        view = View(record=Participant(self.addr, nproc, master_port), deadline=self._clock() + self._settings.join_timeout)
        snap = self._read()
        while True:
            self._check_running()
            now = self._clock()
            view = track_last_call(snap.state, self._settings, self._with_log(view, snap.state), now)
            action = decide_join(snap.state, self.node, self._settings, view, now)
            if action.act is Act.DONE:
                return info_for(snap.state, self.node, self._settings.run_id, self._keys.job(snap.state.round))
            if action.act is Act.CLOSED:
                raise RendezvousClosedError(f"rendezvous '{self._settings.run_id}' is closed")
            if action.act is Act.ANNOUNCE:
                self._log.append(snap.state.round, Announcement(self.node, view.record))
            elif action.act is Act.WAIT:
                snap = self._wait(snap, action.until)
            elif action.act is Act.TIMED_OUT:
                snap = self._time_out(snap, action, view)
            else:
                snap, _ = self._write(snap, action.state)

    def _time_out(self, snap: _Snapshot, action: Action, view: View) -> _Snapshot:
        """Leave the round (best effort: a lost race decides again), then raise."""
        message = self._timeout_message(snap.state, view)
        if action.state is not None:
            snap, won = self._write(snap, action.state)
            if not won:
                return snap
        raise RendezvousTimeoutError(message)

    def _timeout_message(self, state: RendezvousState, view: View) -> str:
        settings = self._settings
        waited = f"rendezvous '{settings.run_id}': {self.node} waited {settings.join_timeout:g}s"
        if state.complete:
            return f"{waited} on the wait list of round {state.round} ({len(state.participants)} members, " \
                   f"max_nodes is {settings.max_nodes})"
        return f"{waited}: {len(joined(state, view))} node(s) joined round {state.round}, min_nodes is {settings.min_nodes}"

    def _check_running(self) -> None:
        if self._stop.is_set():
            raise RendezvousClosedError(f"the rendezvous handler of {self.node} was shut down")
        if self._left:
            raise RendezvousClosedError(f"{self.node} left rendezvous '{self._settings.run_id}'")

    # -- rounds ----------------------------------------------------------------------------

    def request_next_round(self, round: int, reason: Reason, lost: Iterable[str] = ()) -> NextRound:
        """Supersede ``round`` (once, whoever asks first). "failure" uses one restart of the
        job-wide budget: EXHAUSTED, and no new round, when none is left. The new round
        completes without waiting for the ``lost`` members (known dead by the caller)."""
        reason = Reason(reason)  # ValueError for an unknown one
        if reason is Reason.INITIAL:
            raise ValueError("the initial round is not requested: it is the first")
        lost = tuple(lost)
        _, action = self._apply(
            lambda state, view: decide_next_round(state, round, reason, self._settings, lost))
        if action.act is Act.OPEN_ROUND:
            log.info("rendezvous %s: %s opened round %d (%s)", self._settings.run_id, self.node, round + 1, reason)
        return _NEXT_ROUND[action.act]

    def leave(self, reason: Reason = Reason.DRAIN) -> None:
        """Leave for good; a complete round that had this node is superseded with ``reason``."""
        self._left = True
        self._apply(lambda state, view: decide_leave(state, self.node, Reason(reason), view))

    def set_closed(self) -> None:
        self._apply(lambda state, view: decide_close(state))

    def is_closed(self) -> bool:
        return self._read().state.closed

    def num_nodes_waiting(self) -> int:
        return num_waiting(self._read().state, self._settings)

    def watch(self, round: int, *, waiting: bool = True) -> Future[RoundEvent]:
        """A future that resolves when ``round`` is superseded, the rendezvous is closed, or
        (with ``waiting``) nodes are waiting to join. Does no I/O in the caller's thread."""
        future: Future[RoundEvent] = Future()
        if self._stop.is_set():
            future.cancel()
            return future
        self.start()
        with self._lock:
            self._watches.append(_Watch(round, waiting, future))
            newest = self._newest.state
        self._resolve_watches(newest)
        self._wake.set()  # the keeper now follows every revision
        return future

    # -- exit barrier ----------------------------------------------------------------------

    def exit_barrier_arrive(self, info: RendezvousInfo) -> None:
        """This node's workers all succeeded in ``info.round`` (idempotent)."""
        if self._store.add(self._keys.exit_arrived(info.round, self.node), 1) != 1:
            return
        if self._store.add(self._keys.exit_count(info.round), 1) >= info.group_world_size:
            self._store.set(self._keys.exit_done(info.round), b"1")

    def exit_barrier_progress(self, info: RendezvousInfo) -> tuple[int, int]:
        return self._store.add(self._keys.exit_count(info.round), 0), info.group_world_size

    def exit_barrier_wait(self, info: RendezvousInfo, timeout: float) -> bool:
        return self._store.wait_for(self._keys.exit_done(info.round), timeout)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the keeper (heartbeats); joining and watching do it implicitly."""
        with self._lock:
            if self._keeper is None and not self._stop.is_set():
                self._keeper = threading.Thread(
                    target=self._keep, name=f"rdzv-keeper-{self._settings.run_id}-{self.node}", daemon=True
                )
                self._keeper.start()

    def shutdown(self, wait: bool = False) -> None:
        """Stop the keeper and cancel pending watches; does not leave the rendezvous.

        The keeper stops at once, or within one keep-alive interval if it is blocked in a
        store wait (it is while a round is watched); ``wait`` blocks until it stopped. Wait
        before the process exits: a thread still inside TCPStore's wait when the interpreter
        exits aborts the process ("terminate called without an active exception").
        """
        self._stop.set()
        self._wake.set()
        with self._lock:
            watches, self._watches = self._watches, []
            keeper = self._keeper
        for w in watches:
            w.future.cancel()
        if wait and keeper is not None and keeper is not threading.current_thread():
            keeper.join()

    # -- the keeper ------------------------------------------------------------------------

    def _keep(self) -> None:
        beats: dict[str, Beat] = {}
        snap, due = self._newest, self._clock()
        while not self._stop.is_set():
            try:
                if self._clock() >= due:
                    due = self._clock() + self._settings.keep_alive_interval
                    snap, beats = self._tick(beats)
                self._resolve_watches(snap.state)
                snap = self._idle(snap, due)
            except RendezvousStateError as err:
                log.error("rendezvous %s: %s", self._settings.run_id, err)
                self._fail_watches(err)
                self._stop.wait(self._settings.keep_alive_interval)
            except StoreError as err:
                log.warning("rendezvous %s: store error in the keeper of %s: %s", self._settings.run_id, self.node, err)
                self._stop.wait(self._settings.keep_alive_interval)
            except Exception as err:  # a bug must not silence this node's heartbeat for good
                log.exception("rendezvous %s: the keeper of %s failed", self._settings.run_id, self.node)
                self._fail_watches(err)
                self._stop.wait(self._settings.keep_alive_interval)

    def _idle(self, snap: _Snapshot, due: float) -> _Snapshot:
        """Until the next tick: follow every state revision while someone watches; otherwise
        sleep on a local event that a new watch() or shutdown() sets."""
        self._wake.clear()
        with self._lock:
            watching = bool(self._watches)
        if watching:
            return self._wait(snap, due)
        self._wake.wait(max(due - self._clock(), 0.0))
        return snap

    def _tick(self, beats: dict[str, Beat]) -> tuple[_Snapshot, dict[str, Beat]]:
        """Heartbeat, read the others' counters, drop the silent ones."""
        now = self._clock()
        self._store.add(self._keys.heartbeat(self.node), 1)
        others: set[str] = set()

        def decide(state: RendezvousState, view: View) -> Action:
            nonlocal beats, others
            others = watched(state, view) - {self.node}
            beats = observe_beats(beats, self._heartbeats(sorted(others)), now)
            return decide_liveness(state, self.node, self._settings, replace(view, beats=beats), now)

        snap, action = self._apply(decide)
        if action.state is not None:
            silent = sorted(others - watched(action.state, View()))
            log.warning("rendezvous %s: %s dropped silent node(s) %s (%s, round %d)", self._settings.run_id,
                        self.node, ", ".join(silent), action.act.value, action.state.round)
        return snap, beats

    def _heartbeats(self, nodes: list[str]) -> dict[str, int | None]:
        values = self._store.get_many([self._keys.heartbeat(n) for n in nodes])
        return {n: None if v is None else int(v) for n, v in zip(nodes, values)}

    def _resolve_watches(self, state: RendezvousState) -> None:
        """Settle the watches that ``state`` answers (outside the lock: callbacks run inline)."""
        with self._lock:
            events = [(w, round_event(state, w.round, self._settings, waiting=w.waiting)) for w in self._watches]
            self._watches = [w for w, event in events if event is None and not w.future.done()]
        for w, event in events:
            if event is not None:
                _settle(w.future, event)

    def _fail_watches(self, err: Exception) -> None:
        with self._lock:
            watches, self._watches = self._watches, []
        for w in watches:
            _settle(w.future, err)

    # -- state I/O -------------------------------------------------------------------------

    def _apply(self, decide: Callable[[RendezvousState, View], Action]) -> tuple[_Snapshot, Action]:
        """Decide on the current state and write the result; on a lost race decide again on
        the state that won (compare_set returns it: no extra read)."""
        snap = self._read()
        while True:
            action = decide(snap.state, self._with_log(View(), snap.state))
            if action.state is None:
                return snap, action
            snap, won = self._write(snap, action.state)
            if won:
                return snap, action

    def _with_log(self, view: View, state: RendezvousState) -> View:
        """``view`` with the open round's join-log records that the state has not folded yet."""
        if state.complete or state.closed:
            return replace(view, announced=(), log_end=None)
        records = self._log.read(state.round)
        fresh = records[state.folded :]
        return replace(view, announced=tuple(r for r in fresh if r), log_end=max(len(records), state.folded))

    def _read(self) -> _Snapshot:
        return self._snapshot(self._store.get(self._keys.state))

    def _write(self, snap: _Snapshot, new: RendezvousState) -> tuple[_Snapshot, bool]:
        new = replace(new, nonce=secrets.token_hex(8))
        won, raw = self._compare_set(snap, new)
        return (self._remember(_Snapshot(new, raw)), True) if won else (self._snapshot(raw), False)

    def _compare_set(self, snap: _Snapshot, new: RendezvousState) -> tuple[bool, bytes | None]:
        sealed = self._signer.seal(encode(new))
        won, current = self._store.compare_set(self._keys.state, snap.raw, sealed)
        if won:
            self._store.set(self._keys.rev(new.version), b"1")
            self._forget(snap.state, new)
        return won, sealed if won else current

    def _forget(self, old: RendezvousState, new: RendezvousState) -> None:
        """Delete what nobody will wait on or read again."""
        if new.version > REV_KEEP:
            self._store.delete(self._keys.rev(new.version - REV_KEEP))
        if new.round > old.round:
            self._store.delete(self._keys.joins(old.round))

    def _wait(self, snap: _Snapshot, until: float) -> _Snapshot:
        """Block until the next state revision or ``until``; then read the state."""
        timeout = until - self._clock()
        if timeout > 0:
            self._store.wait_for(self._keys.rev(snap.state.version + 1), timeout)
        return self._read()

    def _snapshot(self, raw: bytes | None) -> _Snapshot:
        if raw is None:
            return self._absent()
        return self._remember(_Snapshot(self._open(raw), raw))

    def _absent(self) -> _Snapshot:
        """No state in the store: a new rendezvous, or a store that lost its data (restore)."""
        with self._lock:
            copy = self._newest.state
        action = decide_restore(copy, self.node)
        if action.state is None:
            return _Snapshot(RendezvousState(), None)
        snap, won = self._write(_Snapshot(RendezvousState(), None), action.state)
        if won:
            log.warning("rendezvous %s: the state vanished; %s restored round %d", self._settings.run_id, self.node, copy.round)
        return snap

    def _open(self, raw: bytes) -> RendezvousState:
        problems: list[str] = []
        state = open_or_refuse(self._signer, self._keys.state, raw, decode,
                               lambda key, why: (problems.append(why), self._refused(key, why)))
        if state is None:
            raise RendezvousStateError(f"refusing the rendezvous state at {self._keys.state}: "
                                       f"{problems[0]}")
        return state

    def _remember(self, snap: _Snapshot) -> _Snapshot:
        with self._lock:
            if snap.state.version >= self._newest.state.version:
                self._newest = snap
        return snap



def _log_refused(key: str, why: str) -> None:
    log.error("refused store record %s: %s", key, why)


def _settle(future: Future, outcome: RoundEvent | Exception) -> None:
    try:
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except InvalidStateError:  # cancelled by its owner meanwhile
        pass
