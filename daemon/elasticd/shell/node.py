"""NodeShell: this node's side of every job, around the pure node core (core/node.py).

One loop takes each event (from the rendezvous, the workers and their channel, the job
table, timers, the heartbeat duty, the control socket), hands it to the core with the time,
and carries out the instructions the core returns: a quick effect at once, an operation as
a task of the shell's one task group whose result comes back as an event.  Nothing here
decides anything about a job: what to do is the core's; how is this file's and
effectors.py's.  Submits, cancels and look-ups of the control socket come in here too.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
import pwd
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any

from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.checkpoints import Holding
from elasticd.core.discovery import Listing
from elasticd.core.events import stimulus_kind
from elasticd.core.hang import HungRank, where
from elasticd.core.model import JobSpec, WorkerGroup
from elasticd.core.node import NodeCore
from elasticd.core.placement import Resources
from elasticd.core.records import JobRecord, Outcome
from elasticd.errors import (
    Conflict,
    LimitExceeded,
    RendezvousClosedError,
    RendezvousGone,
    RendezvousTimeoutError,
    StoreConnectionError,
    StoreError,
)
from elasticd.faults import Faults
from elasticd.jobs.board import JOB_ID, BoardFollower, IdTaken, JobBoard, new_job_id
from elasticd.jobs.registry import JobRegistry
from elasticd.journal import about
from elasticd.shell.effectors import Effectors, PartEffectors
from elasticd.shell.publisher import PartPublisher, StoreReset, republish

log = logging.getLogger(__name__)
said = logging.getLogger("elasticd.core")  # what the node core says (instructions.Say)

_ID_DRAWS = 64  # random job ids tried before a submit is refused (each one a store read)
_ID_DRAWS_A_LENGTH = 8  # ids of one length tried before longer ones
_ID_RACES = 8  # submits that lost their drawn id to another node's before one is refused
_LEAVE_TIMEOUT = 5.0  # telling the rendezvous we leave is a courtesy: heartbeats tell it anyway
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


class NodeShell:
    def __init__(
        self,
        core: NodeCore,
        *,
        effectors: Effectors,
        board: JobBoard,
        follower: BoardFollower,
        registry: JobRegistry,
        metrics: Any,
        faults: Faults | None = None,
        standalone: bool = False,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.core = core
        self._effectors = effectors
        self._board = board
        self._follower = follower
        self._registry = registry
        self._metrics = metrics
        self._faults = faults or Faults()
        self._standalone = standalone
        self._clock, self._wall = clock, wall_clock
        self._publisher = PartPublisher(board, self._faults)
        self._queue: asyncio.Queue[ev.Event | StoreReset] = asyncio.Queue()
        self._parts: dict[str, PartEffectors] = {}
        self._settled: dict[str, asyncio.Event] = {}  # job -> set once nothing of it runs here
        self._finishes: dict[str, list[asyncio.Future[Outcome]]] = {}  # cancels awaiting an outcome
        self._node_ops: dict[int, asyncio.Task[Any]] = {}
        self._node_timers: dict[tuple[str, Any], asyncio.TimerHandle] = {}
        self._failed_start: set[str] = set()
        self._jobs_posted = False
        self._tasks: asyncio.TaskGroup | None = None
        self._republishing: set[asyncio.Task[None]] = set()  # StoreReset's tasks
        self._stimuli = itertools.count(1)  # names each stimulus as it comes in
        registry.subscribe(lambda record: self._jobs_changed())

    # -- the loop ------------------------------------------------------------------------------

    def post(self, event: ev.Event | StoreReset) -> None:
        self._queue.put_nowait(event)

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the board and serve the core until ``stop`` is set; then every job here
        stops (a one-node cluster's are cancelled, a larger one's left) and the last parts
        reach the board."""
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            await self._follower.resync()
            while not self._queue.empty():  # what start-up found (events.Restored), first
                self._dispatch(self._queue.get_nowait())
            self._republish_parts()
            following = tasks.create_task(self._follower.run())
            publishing = tasks.create_task(self._publisher.run())
            stopping = tasks.create_task(self._stop_on(stop, following))
            self._jobs_changed()
            await self._serve()
            stopping.cancel()
            for task in list(self._republishing):  # as the heartbeat that awaits it is cancelled
                task.cancel()
            for timer in self._node_timers.values():
                timer.cancel()
            # the publishing loop first (a part it was publishing stays pending), then the
            # last parts, each once
            publishing.cancel()
            await asyncio.wait([publishing])
            await self._publisher.flush()
        self._tasks = None

    async def _stop_on(self, stop: asyncio.Event, following: asyncio.Task[None]) -> None:
        await stop.wait()
        following.cancel()  # it may be waiting on a store that does not answer
        self.post(ev.ShutdownAsked(self._standalone))

    async def _serve(self) -> None:
        while not (self.core.stopping and self._idle()):
            self._dispatch(await self._queue.get())

    def _idle(self) -> bool:
        return not (self.core.parts or self.core.finishing or self._parts or self._node_ops)

    def _dispatch(self, event: ev.Event | StoreReset) -> None:
        if isinstance(event, StoreReset):
            self._republish(event.done)
            return
        fresh = self._refresh(event)
        if fresh is None:
            return
        if not fresh.stimulus_id:
            fresh = replace(fresh, stimulus_id=f"{stimulus_kind(fresh)}-{next(self._stimuli)}")
        now = ev.Now(self._clock(), self._wall())
        try:
            instructions = self.core.handle(fresh, now)
        except Exception as exc:
            self._refused(fresh, exc)
            return
        self._failed_start.clear()
        for instruction in instructions:
            self._execute(instruction)

    def _refused(self, event: ev.Event, exc: Exception) -> None:
        """The core raised (an event a state does not take: a bug): it is logged with the
        job's story and counted; the job's part, if it has one here, fails saying so (once)."""
        job = getattr(event, "job", None)
        story = "\n".join(self.core.job_story(job)[-30:]) if job else ""
        self._faults.report(
            "core",
            f"{type(event).__name__}" + (f" of job {job}; its story:\n{story}" if job else ""),
        )
        if job in self.core.parts and not isinstance(event, ev.OpFailed):
            self.post(
                ev.OpFailed(
                    job, None, False, f"the node core refused {type(event).__name__}: {exc}"
                )
            )

    def _refresh(self, event: ev.Event) -> ev.Event | None:
        """What an effector's news is at the moment the core hears it: the workers as they
        are now; a worker's ask only while its slot is still its own; the job table now."""
        if isinstance(event, ev.WorkersChanged):
            part = self._parts.get(event.job)
            if part is None or part.workers is None:
                return None
            return ev.WorkersChanged(event.job, part.workers.group, part.workers.failures)
        if isinstance(event, ev.WorkerAsked):
            part = self._parts.get(event.job)
            if part is None or part.link is None or part.link.asked(event.slot) < event.after:
                return None
            return event
        if isinstance(event, ev.JobsChanged):
            self._jobs_posted = False
            jobs = tuple(self._registry.jobs())
            return ev.JobsChanged(jobs, self._users(jobs))
        return event

    def _jobs_changed(self) -> None:
        """The job table changed: the core hears of it once, however many changes came."""
        if not self._jobs_posted:
            self._jobs_posted = True
            self.post(ev.JobsChanged(()))

    def _users(self, jobs: tuple[JobRecord, ...]) -> dict[int, str | None]:
        """The local name of each uid of an open job (a root daemon judges who runs what)."""
        if os.getuid() != 0:
            return {}
        names: dict[int, str | None] = {}
        for record in jobs:
            uid = record.spec.uid
            if record.outcome is None and uid not in names and uid not in self.core.users:
                try:
                    names[uid] = pwd.getpwuid(uid).pw_name
                except KeyError:
                    names[uid] = None
        return names

    # -- carrying out instructions ----------------------------------------------------------------

    def _execute(self, instruction: do.Instruction) -> None:
        job = getattr(instruction, "job", None)
        if job in self._failed_start:
            return  # its part could not start: what it asked for has nothing to act on
        try:
            _EXECUTE[type(instruction)](self, instruction)
        except Exception as exc:
            self._faults.report(
                "shell", f"{type(instruction).__name__}" + (f" of job {job}" if job else "")
            )
            op = getattr(instruction, "op", None)
            if job is not None and job in self._parts:
                self.post(ev.OpFailed(job, op, False, f"{type(instruction).__name__}: {exc!r}"))

    def _op(
        self,
        job: str,
        op: int,
        work: Awaitable[Any],
        done: Callable[[Any], ev.Event],
        fail: Callable[[Exception], ev.Event | None] = lambda exc: None,
    ) -> None:
        """Run ``work`` as the part's operation ``op``; its result (``done``), or its error
        (``fail``, else a store error or a bug), comes back as an event."""
        part = self._parts[job]

        async def run() -> None:
            try:
                result = await work
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                event = fail(exc)
                if event is None and isinstance(exc, StoreError):
                    event = ev.OpFailed(job, op, True, str(exc))
                elif event is None:
                    log.exception("job %s: operation %d failed", job, op, extra=about(job))
                    event = ev.OpFailed(job, op, False, repr(exc))
                self.post(event)
            else:
                self.post(done(result))
            finally:
                part.ops.pop(op, None)

        part.ops[op] = self._start(run(), work, name=f"{job}-op{op}")

    # rendezvous

    def _join(self, join: do.Join) -> None:
        part = self._parts[join.job]
        ports = join.master_ports or (self._effectors.master_ports.pick(self._effectors.address),)
        try:
            port = part.stores.offer(ports)  # listening before the round forms, whoever is first
        except StoreConnectionError as exc:
            self.post(_store_taken(join.job, join.op, exc))
            return

        def fail(exc: Exception) -> ev.Event | None:
            kinds: dict[type[Exception], str] = {
                RendezvousClosedError: ev.JoinFailure.CLOSED,
                RendezvousGone: ev.JoinFailure.GONE,
                RendezvousTimeoutError: ev.JoinFailure.TIMEOUT,
            }
            kind = kinds.get(type(exc))
            return ev.JoinFailed(join.job, join.op, kind, str(exc)) if kind else None

        self._op(
            join.job,
            join.op,
            part.rdzv.next_rendezvous(join.nproc, port, join.scheduled, self._holding(join.job)),
            lambda info: self._round_joined(join.job, join.op, info),
            fail,
        )

    def _holding(self, job: str) -> Holding | None:
        """What this node holds of the job's newest complete checkpoint, for its rendezvous
        record (the round's ranks go where the state is)."""
        tier = self._effectors.tier
        return None if tier is None else tier.holding(job)

    def _round_joined(self, job: str, op: int, info: Any) -> ev.Event:
        """A round formed with this node: the failure detector watches its members; its
        store is served here if this node is its first."""
        part = self._parts.get(job)
        if part is not None:
            try:
                part.stores.formed(
                    info.round, info.master_port, info.members[0].node == self._effectors.node
                )
            except StoreConnectionError as exc:  # its workers would wait for it in vain
                return _store_taken(job, op, exc)
        guard = self._effectors.guard
        if guard is not None:
            guard.watch(job, tuple(m.node for m in info.members))
        return ev.RoundJoined(job, op, info)

    def _watch(self, watch: do.Watch) -> None:
        part = self._parts[watch.job]
        watching = part.rdzv.watch(watch.round, waiting=watch.waiting)
        self._op(
            watch.job, watch.op, watching, lambda event: ev.RoundChanged(watch.job, watch.op, event)
        )

    def _request_round(self, request: do.RequestRound) -> None:
        part = self._parts[request.job]
        self._op(
            request.job,
            request.op,
            part.rdzv.request_next_round(request.round, request.reason, request.lost),
            lambda result: ev.RoundRequested(request.job, request.op, result),
        )

    def _arrive(self, arrival: do.ArriveAtBarrier) -> None:
        rdzv = self._parts[arrival.job].rdzv

        async def barrier() -> tuple[int, int]:
            await rdzv.exit_barrier_arrive(arrival.info)
            await rdzv.exit_barrier_wait(
                arrival.info,
                arrival.timeout,
                lambda done, total: self.post(
                    ev.BarrierProgress(arrival.job, arrival.op, done, total)
                ),
            )
            return await rdzv.exit_barrier_progress(arrival.info)

        self._op(
            arrival.job,
            arrival.op,
            barrier(),
            lambda counts: ev.BarrierDone(arrival.job, arrival.op, *counts),
        )

    def _leave(self, leaving: do.Leave) -> None:
        rdzv = self._parts[leaving.job].rdzv

        async def leave() -> None:
            try:
                async with asyncio.timeout(_LEAVE_TIMEOUT):
                    await rdzv.leave(leaving.reason)
            except TimeoutError:
                raise StoreError("no answer") from None

        self._op(leaving.job, leaving.op, leave(), lambda _: ev.Left(leaving.job, leaving.op))

    def _probe(self, probing: do.Probe) -> None:
        probe = self._effectors.probe.unreachable(list(probing.nodes), probing.timeout)
        self._op(
            probing.job,
            probing.op,
            probe,
            lambda lost: ev.PeersProbed(probing.job, probing.op, tuple(lost)),
        )

    def _cancel(self, cancel: do.Cancel) -> None:
        part = self._parts.get(cancel.job)
        task = (
            part.ops.pop(cancel.op, None)
            if part is not None
            else self._node_ops.pop(cancel.op, None)
        )
        if task is not None:
            task.cancel()

    # workers

    def _start_workers(self, start: do.StartWorkers) -> None:
        part = self._parts[start.job]
        if start.pool:
            assert part.workers is not None
            part.workers.log_dir = part.attempt_dir(start.round)
        else:
            part.new_workers(
                start.group, start.round, lambda g: self.post(ev.WorkersChanged(start.job, g))
            )
        assert part.workers is not None
        self._in_round(start.job, start.group)
        self._quiet(start.job, part.workers.start())

    def _in_round(self, job: str, group: WorkerGroup) -> None:
        """The checkpoint tier learns whose saves come next: this round's ranks here."""
        tier = self._effectors.tier
        if tier is not None and group.round >= 0:
            ranks = tuple(w.rank for w in group.workers if w.rank >= 0)
            tier.round(job, group.round, group.world_size, ranks)

    def _prepare_restore(self, preparing: do.PrepareRestore) -> None:
        tier = self._effectors.tier
        work = (
            tier.prepare(
                preparing.job,
                self._registry.find(preparing.job),
                preparing.members,
                preparing.checkpoint,
            )
            if tier is not None
            else asyncio.sleep(0, "")
        )
        self._op(
            preparing.job,
            preparing.op,
            work,
            lambda failure: ev.RestorePrepared(preparing.job, preparing.op, failure or ""),
        )

    def _new_pool(self, new_pool: do.NewPool) -> None:
        self._parts[new_pool.job].new_workers(
            new_pool.group, 0, lambda g: self.post(ev.WorkersChanged(new_pool.job, g))
        )

    def _warm(self, warm: do.WarmWorkers) -> None:
        part = self._parts[warm.job]
        assert part.workers is not None
        part.workers.log_dir = part.attempt_dir(warm.round)
        self._quiet(warm.job, part.workers.warm(list(warm.slots)))

    def _place_workers(self, placing: do.PlaceWorkers) -> None:
        part = self._parts[placing.job]
        assert part.workers is not None and part.link is not None
        part.workers.place(placing.group, part.attempt_dir(placing.group.round))
        part.link.place_round(placing.group.round, placing.envs)
        self._in_round(placing.job, placing.group)

    def _notify(self, notice: do.Notify) -> None:
        link = self._parts[notice.job].link
        assert link is not None
        if notice.abort:
            link.abort(notice.round)
        if notice.added is not None:
            link.announce(notice.round, notice.added)

    def _forget(self, forget: do.ForgetSlots) -> None:
        link = self._parts[forget.job].link
        assert link is not None
        for slot in forget.slots:
            link.forget(slot)

    def _fail_slots(self, failing: do.FailSlots) -> None:
        workers = self._parts[failing.job].workers
        assert workers is not None
        self._quiet(failing.job, workers.stop_slots(failing.slots, failure=failing.why))

    def _dump_stacks(self, dump: do.DumpStacks) -> None:
        part = self._parts[dump.job]
        workers, link = part.workers, part.link

        async def stacks() -> tuple[HungRank, ...]:
            if workers is None:
                return ()
            texts = await workers.dump_stacks(
                dump.slots, link.stack_signals if link is not None else {}
            )
            ranks = {w.local_rank: w.rank for w in workers.group.workers}
            found = []
            for slot in dump.slots:
                inside, frame = where(texts.get(slot, ""))
                found.append(HungRank(slot, ranks.get(slot, -1), inside, frame))
            return tuple(found)

        self._op(dump.job, dump.op, stacks(), lambda ranks: ev.RanksHung(dump.job, dump.op, ranks))

    def _stop_workers(self, stopping: do.StopWorkers) -> None:
        workers = self._parts[stopping.job].workers
        tier = self._effectors.tier

        if tier is not None:  # what it holds now is what it declares, joining the next round
            tier.stopped(stopping.job)

        async def stop() -> None:
            if workers is not None:
                await workers.stop()

        self._op(
            stopping.job,
            stopping.op,
            stop(),
            lambda _: ev.WorkersStopped(stopping.job, stopping.op),
        )

    def _shed(self, shed: do.ShedSpares) -> None:  # a node operation: the part may close meanwhile
        workers = self._parts[shed.job].workers if shed.job in self._parts else None
        self._node_op(
            shed.op,
            workers.stop_slots(shed.slots) if workers is not None else asyncio.sleep(0),
            lambda _: ev.SparesShed(shed.job, shed.op, shed.slots),
            lambda _: ev.SparesShed(shed.job, shed.op, ()),
        )

    def _quiet(self, job: str, work: Awaitable[Any]) -> None:
        """A part's effect whose only news is a failure (as a store error or a bug)."""
        part = self._parts[job]

        async def run() -> None:
            try:
                await work
            except asyncio.CancelledError:
                raise
            except StoreError as exc:
                self.post(ev.OpFailed(job, None, True, str(exc)))
            except Exception as exc:
                log.exception("job %s: an effect failed", job, extra=about(job))
                self.post(ev.OpFailed(job, None, False, repr(exc)))

        task = self._start(run(), work)
        key = -id(task)
        part.ops[key] = task
        task.add_done_callback(lambda _: part.ops.pop(key, None))

    # records

    def _publish(self, publish: do.Publish) -> None:
        part = self._parts.get(publish.job)
        usage = part.usage() if part is not None else None
        own = (
            publish.part
            if usage is None
            else type(publish.part)(**{**publish.part.__dict__, "usage": usage})
        )
        record = self._registry.set_part(publish.job, own, own=True)
        if record is not None:  # as recorded: with why this node holds the job, if it does
            self._publisher.publish(publish.job, record.parts.get(own.node, own))

    def _finish_job(self, finishing: do.Finish) -> None:
        async def finish() -> Outcome:
            final = await self._finish(finishing.job, finishing.outcome, finishing.board)
            for waiter in self._finishes.pop(finishing.job, []):
                if not waiter.done():
                    waiter.set_result(final)
            return final

        def fail(exc: Exception) -> ev.Event | None:
            for waiter in self._finishes.pop(finishing.job, []):
                if not waiter.done():
                    waiter.set_exception(exc)
            return None

        if finishing.op > 0:  # a part's own (the node's are numbered below zero)
            self._op(
                finishing.job,
                finishing.op,
                finish(),
                lambda final: ev.Finished(finishing.job, finishing.op, final),
                fail,
            )
            return
        self._node_op(
            finishing.op,
            finish(),
            lambda final: ev.Finished(finishing.job, finishing.op, final),
            lambda exc: (
                fail(exc)
                or ev.OpFailed(finishing.job, finishing.op, isinstance(exc, StoreError), str(exc))
            ),
        )

    def _node_op(
        self,
        op: int,
        work: Awaitable[Any],
        done: Callable[[Any], ev.Event],
        fail: Callable[[Exception], ev.Event],
    ) -> None:
        async def run() -> None:
            try:
                self.post(done(await work))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not isinstance(exc, StoreError):
                    log.exception("operation %d of the node failed", op)
                self.post(fail(exc))
            finally:
                self._node_ops.pop(op, None)

        self._node_ops[op] = self._start(run(), work)

    def _start(
        self, run: Coroutine[Any, Any, None], work: Awaitable[Any], name: str | None = None
    ) -> asyncio.Task[None]:
        """``run`` (which awaits ``work``) as a task of the shell's group.  A task cancelled
        before its first step never awaits ``work``: a coroutine is closed then, as Python
        would warn of one nobody awaited (a probe cancelled at once by the next failure)."""
        assert self._tasks is not None
        task = self._tasks.create_task(run, name=name)
        if inspect.iscoroutine(work):
            task.add_done_callback(lambda _: work.close())
        return task

    async def _finish(self, job_id: str, outcome: Outcome, board: bool = True) -> Outcome:
        """Make ``outcome`` the job's outcome unless another was first; close its rendezvous
        (``board`` False: in this node's record only)."""
        record = self._registry.get(job_id)
        if record.outcome is not None:
            return record.outcome
        if not board:
            self._registry.set_outcome(job_id, outcome)
            return outcome
        final = await self._board.publish_outcome(job_id, outcome)
        if final is outcome:  # this node's outcome won: its spec record says so too
            await self._board.publish_ended(record.spec, record.seq, final)
        self._registry.set_outcome(job_id, final)
        await self._effectors.rendezvous(record.spec).set_closed()
        return final

    def _hold_job(self, hold: do.HoldJob) -> None:
        self._registry.hold(hold.job, hold.why)

    # life cycle, time, words

    def _start_part(self, starting: do.StartPart) -> None:
        def asked(ready: Any) -> None:
            self.post(ev.WorkerAsked(starting.job, ready.slot, ready.after, ready.why, ready.error))

        try:
            part = self._effectors.part(
                starting.spec,
                starting.nproc,
                starting.started,
                asked,
                lambda lost: self.post(ev.NodesLost(lost)),
                lambda slot: self.post(ev.Progressed(starting.job, slot)),
            )
        except Exception as exc:
            log.exception(
                "job %s: cannot start its agent on %s",
                starting.job,
                self.core.settings.node,
                extra=about(starting.job),
            )
            self._failed_start.add(starting.job)
            self.post(ev.PartStartFailed(starting.job, str(exc)))
            return
        assert self._tasks is not None
        self._parts[starting.job] = part
        self._settled[starting.job] = asyncio.Event()
        part.keeper = self._tasks.create_task(part.rdzv.keep(), name=f"keeper-{starting.job}")
        if part.link is not None:
            self._quiet(starting.job, part.link.serve())

    def _close_part(self, closing: do.ClosePart) -> None:
        part = self._parts[closing.job]

        guard = self._effectors.guard
        if guard is not None:
            guard.unwatch(closing.job)

        async def close() -> None:
            try:
                await part.close()
            finally:
                del self._parts[closing.job]
                self._settled.pop(closing.job, asyncio.Event()).set()
                self.post(ev.PartClosed(closing.job))

        assert self._tasks is not None
        self._tasks.create_task(close(), name=f"close-{closing.job}")

    def _set_timer(self, timer: do.SetTimer) -> None:
        delay = max(0.0, timer.at - self._clock())
        loop = asyncio.get_running_loop()
        if timer.job is None:
            key = (timer.name, timer.key)
            if key in self._node_timers:
                self._node_timers[key].cancel()
            self._node_timers[key] = loop.call_later(
                delay, self.post, ev.NodeTimerFired(timer.name, timer.key)
            )
            return
        part = self._parts[timer.job]
        part.timers[timer.name] = loop.call_later(
            delay, self.post, ev.TimerFired(timer.job, timer.name)
        )

    def _clear_timer(self, clear: do.ClearTimer) -> None:
        if clear.job is None:
            timer = self._node_timers.pop((clear.name, clear.key), None)
        else:
            part = self._parts.get(clear.job)
            timer = part.timers.pop(clear.name, None) if part is not None else None
        if timer is not None:
            timer.cancel()

    def _count(self, count: do.Count) -> None:
        metrics = self._metrics
        if count.what == "round_joined":
            metrics.round_joined(count.label, count.value)
        elif count.what == "worker_exited":
            metrics.worker_exited(int(count.value))
        elif count.what == "restarted":
            metrics.restarted()
        elif count.what == "barrier_waited":
            metrics.barrier_waited(count.value)
        elif count.what == "blacklisted":
            metrics.blacklisted(bool(count.value))
        elif count.what == "reclaimed":
            metrics.reclaimed()
        elif count.what in ("gpus_out", "gpu_fault", "xid", "gpu_slowdown"):
            metrics.gpu_news(count.what, count.label, count.value)

    def _say(self, say: do.Say) -> None:
        said.log(
            _LEVELS[say.level], say.message, *say.args, extra=about(say.job) if say.job else None
        )

    # -- for the control socket and the node's record ---------------------------------------------

    async def unused_job_id(self) -> str:
        """An id for a new job that no job in this node's registry or in the store ever had:
        the outcomes of forgotten jobs stay in the store, and a job that drew one of their
        ids would end, as that one did, before it ran.  Six hex digits while most are free;
        two more after every ``_ID_DRAWS_A_LENGTH`` taken ones (12 at most)."""
        for draw in range(_ID_DRAWS):
            job_id = new_job_id(min(6 + 2 * (draw // _ID_DRAWS_A_LENGTH), 12))
            if self._registry.find(job_id) is None and not await self._board.ever_had(job_id):
                return job_id
        raise LimitExceeded(f"no unused job id in {_ID_DRAWS} draws: is the store sound?")

    async def submit_new(self, spec: JobSpec) -> JobRecord:
        """Publish ``spec`` as a new job under an id that no job ever had (unused_job_id);
        drawn again where a submit on another node took it between the check and the
        publish."""
        for _ in range(_ID_RACES):
            try:
                return await self.submit(replace(spec, id=await self.unused_job_id()))
            except IdTaken:
                continue
        raise LimitExceeded(f"{_ID_RACES} draws in a row lost their job id to other submits")

    async def submit(self, spec: JobSpec) -> JobRecord:
        """Publish a new job.  It is in this node's history first: a job that could not be
        recorded (a full disk) is refused before any node could take it.  IdTaken where
        another node published a job under its id first."""
        seq = await self._board.next_seq()
        if self._registry.find(spec.id) is not None:  # the follower read it meanwhile
            raise IdTaken(spec.id)
        self._registry.reserve(spec, seq)
        try:
            await self._board.publish_spec(spec, seq, new=True)
        except BaseException:
            self._registry.unreserve(spec.id)
            raise
        return self._registry.add(spec, seq)

    async def cancel(self, job_id: str, by: str) -> JobRecord:
        record = self._registry.get(job_id)
        if record.outcome is not None:
            raise Conflict(f"job {job_id} already ended ({record.state.value})")
        ended: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._finishes.setdefault(job_id, []).append(ended)
        self.post(ev.CancelAsked(job_id, by, record.spec))
        await ended
        await self.settled(job_id)
        return self._registry.get(job_id)

    async def fetch(self, job_id: str) -> JobRecord | None:
        """One job read from the board now (ahead of the change log); None if it has none
        (or ``job_id`` is no job id: a prefix typed by a user is looked up locally only)."""
        if not JOB_ID.match(job_id):
            return None
        await self._follower.fetch(job_id)
        return self._registry.find(job_id)

    async def settled(self, job_id: str) -> None:
        """Return once this node runs nothing of the job (its workers stopped, logs drained)."""
        settled = self._settled.get(job_id)
        if settled is not None:
            await settled.wait()

    def usage(self) -> dict[str, dict]:
        """The live usage of every job running here, by job id (jobs without a cgroup left out)."""
        return {
            job_id: usage for job_id in self._parts if (usage := self.usage_of(job_id)) is not None
        }

    def usage_of(self, job_id: str) -> dict | None:
        part = self._parts.get(job_id)
        return part.usage() if part is not None else None

    def job_story(self, job_id: str) -> list[str]:
        return self.core.job_story(job_id)

    def node_story(self) -> list[str]:
        return self.core.node_story()

    @property
    def resources(self) -> Resources:
        assert self.core.resources is not None
        return self.core.resources

    @property
    def draining(self) -> bool:
        return self.core.draining

    @property
    def listed(self) -> bool:
        return self.core.listed

    @property
    def blacklisted_until(self) -> float:
        return self.core.blacklisted_until

    @property
    def gpus_out(self) -> dict[int, str]:
        """The GPUs its health checks took out of this node's offer, by index, and why."""
        watch = self.core.gpu_watch
        return watch.why_out() if watch is not None else {}

    def used(self) -> Resources:
        return self.core.used()

    def local_jobs(self) -> list[str]:
        return self.core.local_jobs()

    def set_listed(self, listing: Listing) -> None:
        self.post(ev.Listed(listing.listed, listing.slots or 0))

    def _republish_parts(self) -> None:
        """At start: this node's part of every job that has not ended, as this node knows it
        last (a part its restart ended is LEFT now), so that no node goes on showing a part
        of this one that no agent runs any more."""
        for record in self._registry.jobs():
            part = record.parts.get(self.core.settings.node)
            if record.outcome is None and part is not None:
                self._publisher.publish(record.id, part)

    def _republish(self, done: asyncio.Future[None]) -> None:
        """StoreReset: publish again (``publisher.republish``), a task beside the loop."""
        assert self._tasks is not None
        task = self._tasks.create_task(
            republish(done, self._board, self._registry, self.core.settings.node, self._follower)
        )
        self._republishing.add(task)
        task.add_done_callback(self._republishing.discard)


_EXECUTE: dict[type, Callable[[NodeShell, Any], None]] = {
    do.Join: NodeShell._join,
    do.PrepareRestore: NodeShell._prepare_restore,
    do.Watch: NodeShell._watch,
    do.RequestRound: NodeShell._request_round,
    do.ArriveAtBarrier: NodeShell._arrive,
    do.Leave: NodeShell._leave,
    do.Probe: NodeShell._probe,
    do.Cancel: NodeShell._cancel,
    do.StartWorkers: NodeShell._start_workers,
    do.NewPool: NodeShell._new_pool,
    do.WarmWorkers: NodeShell._warm,
    do.PlaceWorkers: NodeShell._place_workers,
    do.Notify: NodeShell._notify,
    do.ForgetSlots: NodeShell._forget,
    do.FailSlots: NodeShell._fail_slots,
    do.DumpStacks: NodeShell._dump_stacks,
    do.StopWorkers: NodeShell._stop_workers,
    do.ShedSpares: NodeShell._shed,
    do.Publish: NodeShell._publish,
    do.Finish: NodeShell._finish_job,
    do.HoldJob: NodeShell._hold_job,
    do.StartPart: NodeShell._start_part,
    do.ClosePart: NodeShell._close_part,
    do.SetTimer: NodeShell._set_timer,
    do.ClearTimer: NodeShell._clear_timer,
    do.Count: NodeShell._count,
    do.Say: NodeShell._say,
}


def _store_taken(job: str, op: int, exc: StoreConnectionError) -> ev.JoinFailed:
    """A join that cannot serve its round's store: the job fails, saying why."""
    why = f"{exc} (another program, or another job's --master-port, holds it)"
    return ev.JoinFailed(job, op, ev.JoinFailure.STORE, why)
