"""What each control op does: turn a checked request into calls on the daemon's services.

Authorization (docs/security.md): root and members of the admin group act on every job;
other users see every job but cancel only their own and read only their own logs, and their
jobs run as themselves.  A daemon not run by root serves only its own user.  What a reply
shows is built for its caller: another user's job comes without its arguments or error
text (records.others_view), and `list` rows carry neither for anyone.
"""

from __future__ import annotations

import asyncio
import collections
import grp
import logging
import os
import pwd
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

from elasticd import __version__
from elasticd.aio import back_off, race
from elasticd.cluster.peers import PeerCaller, PeerLinks
from elasticd.cluster.service import NodeService
from elasticd.config import DaemonConfig
from elasticd.control.server import Caller, PeerGone, Responder
from elasticd.core.model import JobSpec, JobState, NodeState, parse_nnodes, parse_nproc
from elasticd.core.placement import beyond_standalone, never_fits
from elasticd.core.quotas import account_refusal, count_refusal, spec_refusal
from elasticd.core.records import JobRecord, job_doc, listed_doc, others_view
from elasticd.core.schedule import Schedule, reason_of, waiting_jobs, waiting_since
from elasticd.core.usage import Span, report, spans
from elasticd.errors import ElasticdError, InvalidSpec, LimitExceeded, NotFound, PermissionDenied
from elasticd.jobs.accounts import account_of, group_name, group_namer, group_names
from elasticd.jobs.board import new_job_id
from elasticd.jobs.registry import JobRegistry
from elasticd.shell.logs import LogBus, LogReader, SeenLines
from elasticd.wire.protocol import LIST_BATCH, Request, batches

log = logging.getLogger(__name__)
RECENT = 24 * 3600  # `list` without --all shows jobs that ended within this many seconds


class JobService(Protocol):
    """What the commands ask of this node's job service (shell.node.NodeShell)."""

    async def submit_new(self, spec: JobSpec) -> JobRecord: ...
    async def cancel(self, job_id: str, by: str) -> JobRecord: ...
    async def fetch(self, job_id: str) -> JobRecord | None: ...
    async def settled(self, job_id: str) -> None: ...
    def usage_of(self, job_id: str) -> dict | None: ...
    def job_story(self, job_id: str) -> list[str]: ...
    def node_story(self) -> list[str]: ...


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def shown_doc(record: JobRecord, *args: Any) -> dict[str, Any]:
    """job_doc with the account named (a spec keeps the submitter's own group as "")."""
    return {**job_doc(record, *args), "account": account_of(record.spec)}


def own_account(account: str, gid: int) -> str:
    """The caller's own group is the default account, and is kept as "" (see jobs/accounts)."""
    return "" if account == group_name(gid) else account


def spec_from_request(
    args: Mapping[str, Any],
    caller: Caller,
    config: DaemonConfig,
    *,
    job_id: str,
    node: str,
    now: float,
) -> JobSpec:
    """The JobSpec a submit request asks for, with the daemon's defaults filled in (pure)."""
    defaults = config.jobs
    low, high = parse_nnodes(args.get("nnodes", 1))
    return JobSpec(
        id=job_id,
        argv=tuple(args["argv"]),
        python=args.get("python", ""),
        workdir=args.get("workdir", ""),
        uid=caller.uid,
        gid=caller.gid,
        user=user_name(caller.uid),
        name=args.get("name") or _default_name(args),
        kind=args.get("kind", "script"),
        env=dict(args.get("env", {})),
        min_nodes=low,
        max_nodes=high,
        nproc_per_node=parse_nproc(args.get("nproc_per_node", 1)),
        max_restarts=args.get("max_restarts", defaults.max_restarts),
        join_timeout=args.get("join_timeout", defaults.join_timeout),
        last_call_timeout=args.get("last_call_timeout", defaults.last_call_timeout),
        exit_barrier_timeout=args.get("exit_barrier_timeout", defaults.exit_barrier_timeout),
        in_place=args.get("in_place", False),
        rejoin_timeout=args.get("rejoin_timeout", JobSpec.rejoin_timeout),
        hang_timeout=float(args.get("hang_timeout", JobSpec.hang_timeout)),
        spares=args.get("spares", JobSpec.spares),
        nodes=tuple(args.get("nodes", ())),
        exclude=tuple(args.get("exclude", ())),
        role=args.get("role", JobSpec.role),
        master_port=args.get("master_port", JobSpec.master_port),
        priority=args.get("priority", JobSpec.priority),
        account=own_account(args.get("account") or "", caller.gid),
        preemptible=args.get("preemptible", False),
        nnodes_step=args.get("nnodes_step", JobSpec.nnodes_step),
        checkpoint_dir=args.get("checkpoint_dir", ""),
        keep_checkpoints=args.get("keep_checkpoints", JobSpec.keep_checkpoints),
        checkpoint_memory=args.get("checkpoint_memory", 0),
        warm_restart=args.get("warm_restart", False),
        submitted_on=node,
        created=now,
    )


def _default_name(args: Mapping[str, Any]) -> str:
    argv = args.get("argv") or [""]
    return os.path.basename(str(argv[0])) or "job"


class Commands:
    def __init__(
        self,
        config: DaemonConfig,
        *,
        node: str,
        registry: JobRegistry,
        jobs: JobService,
        logs: LogBus,
        cluster: NodeService,
        peers: PeerLinks,
        schedule: Callable[[], Schedule | None] = lambda: None,
    ) -> None:
        self._config = config
        self._node = node
        self._registry = registry
        self._jobs = jobs
        self._logs = logs
        self._cluster = cluster
        self._peers = peers
        self._schedule = schedule  # the cluster's schedule as this node follows it
        self._submitting: collections.Counter[int] = (
            collections.Counter()
        )  # uid -> submits under way
        self._ops: dict[str, Callable[[Caller, dict[str, Any], Responder], Awaitable[None]]] = {
            "version": self.version,
            "submit": self.submit,
            "list": self.list,
            "status": self.status,
            "logs": self.logs,
            "cancel": self.cancel,
            "wait": self.wait,
            "nodes": self.nodes_list,
            "drain": self.drain,
            "undrain": self.undrain,
            "queue": self.queue,
            "usage": self.usage,
        }

    async def __call__(self, caller: Caller, request: Request, reply: Responder) -> None:
        self._admit(caller)
        handler = self._ops.get(request.op)
        if handler is None:
            raise InvalidSpec(f"{request.op} is not available on this daemon")
        await handler(caller, request.args, reply)

    def _admit(self, caller: Caller) -> None:
        daemon_uid = os.getuid()
        if daemon_uid != 0 and caller.uid != daemon_uid:
            raise PermissionDenied(f"this elasticd serves {user_name(daemon_uid)} only")

    def _is_admin(self, caller: Caller) -> bool:
        if caller.uid == 0:
            return True
        try:
            admin_gid = grp.getgrnam(self._config.control.admin_group).gr_gid
            return admin_gid in os.getgrouplist(user_name(caller.uid), caller.gid)
        except (KeyError, OSError):
            return False

    def _sees_all(self, caller: Caller, record: JobRecord) -> bool:
        """Whether ``caller`` sees the whole job: its owner, root and the admin group."""
        return caller.uid == record.spec.uid or self._is_admin(caller)

    def _check_owner(self, caller: Caller, record: JobRecord, what: str) -> None:
        if caller.uid != record.spec.uid and not self._is_admin(caller):
            raise PermissionDenied(
                f"job {record.id} belongs to {record.spec.user}; you may not {what} it"
            )

    async def _find(self, job: str) -> JobRecord:
        """A job by id or by a unique prefix of its id; a full id not seen here yet (it was
        submitted elsewhere a moment ago) is read from the cluster's board."""
        record = self._registry.find(job) or await self._jobs.fetch(job)
        if record is not None:
            return record
        matches = (
            [r for r in self._registry.jobs() if r.id.startswith(job)] if len(job) >= 3 else []
        )
        if len(matches) == 1:
            return matches[0]
        raise NotFound(f"no job {job!r}" if not matches else f"{job!r} matches several jobs")

    # -- ops ----------------------------------------------------------------------------------

    async def version(self, caller: Caller, args: dict[str, Any], reply: Responder) -> None:
        await reply.result(
            {
                "version": __version__,
                "node": self._node,
                "cluster": self._config.cluster.name,
                **self._cluster.store_health(),
            }
        )

    async def submit(self, caller: Caller, args: dict[str, Any], reply: Responder) -> None:
        spec = spec_from_request(
            args,
            caller,
            self._config,
            job_id=new_job_id(),  # provisional: the one it keeps is drawn once it may run
            node=self._node,
            now=time.time(),
        )
        if spec.uid == 0 and os.getuid() == 0 and not self._config.jobs.allow_root:
            raise PermissionDenied(
                "jobs submitted by root are refused here (jobs.allow_root = "
                "false; `elasticd --allow-root` allows them)"
            )
        problem = spec_refusal(spec, self._config.jobs.limits) or self._over_quota(caller, spec)
        if problem:
            raise LimitExceeded(problem)
        problem = self._sharing_refusal(caller, spec)
        if problem:
            raise PermissionDenied(problem)
        # The script, python and workdir are not looked at here: a root daemon would answer
        # with its own rights (an oracle for files the user cannot see).  elasticctl checks
        # them as the user; a worker that cannot find them fails as the user would.
        self._submitting[spec.uid] += 1  # counted from the check until the registry has the job
        try:
            problem = await self._never_starts(spec)
            if problem:
                raise InvalidSpec(problem)
            record = await self._jobs.submit_new(spec)
        finally:
            self._submitting[spec.uid] -= 1
            if not self._submitting[spec.uid]:
                del self._submitting[spec.uid]
        if args.get("wait"):
            await self._stream_until_done(record, reply, full=True)
        else:
            await reply.result(shown_doc(record))

    def _sharing_refusal(self, caller: Caller, spec: JobSpec) -> str | None:
        """Why the caller may not charge ``spec`` to its account or ask its priority (root
        and the admin group may name any of either)."""
        admin, groups = self._is_admin(caller), group_names(spec.user, caller.gid)
        return account_refusal(
            account_of(spec), spec.user, groups, admin
        ) or self._config.scheduler.priority_bounds.refusal(spec.priority, spec.user, groups, admin)

    def _over_quota(self, caller: Caller, spec: JobSpec) -> str | None:
        """Why the caller may not have one more job that has not ended (root and the admin
        group may).  Counted over every job this node knows, the cluster's board included,
        and this node's submits under way."""
        if self._is_admin(caller):
            return None
        open_jobs = sum(
            1 for r in self._registry.jobs() if r.spec.uid == spec.uid and r.outcome is None
        )
        return count_refusal(
            spec.user, open_jobs + self._submitting[spec.uid], self._config.jobs.limits
        )

    async def _never_starts(self, spec: JobSpec) -> str | None:
        """Why the job could never start here (None: it may)."""
        if self._config.standalone and (problem := beyond_standalone(spec)):
            return problem
        if never_fits(spec, self._cluster.nodes()) is None:
            return None
        return never_fits(spec, await self._cluster.fresh())  # the view may be a heartbeat old

    async def list(self, caller: Caller, args: dict[str, Any], reply: Responder) -> None:
        """A stream of ``{"jobs": [row, ...]}`` replies, each at most about LIST_BATCH bytes,
        then the end: never one frame of every job.  The rows are of the jobs as they were
        when the request came, built as the client takes them."""
        horizon = time.time() - RECENT
        records = [
            r
            for r in self._registry.jobs()
            if args.get("all") or r.outcome is None or r.outcome.ended >= horizon
        ]
        schedule = self._schedule()
        rows = (allocated(listed_doc(r), r, schedule) for r in records)
        for batch in batches(rows, LIST_BATCH):
            await reply.result({"jobs": batch})
        await reply.end()

    async def queue(self, caller: Caller, args: dict[str, Any], reply: Responder) -> None:
        """The waiting jobs in the order they will start, each with why it waits (Slurm's
        words); without a schedule (the scheduler is off, or not heard from), the open jobs
        no node runs, in submit order."""
        schedule = self._schedule()
        waiting = waiting_jobs(self._registry.jobs(), schedule, account_of)
        await reply.result(
            {
                "scheduler": schedule is not None,
                "schedule": [schedule.term, schedule.number] if schedule is not None else None,
                "jobs": [
                    queue_row(record, reason, position, schedule)
                    for position, (record, reason) in enumerate(waiting, 1)
                ],
            }
        )

    async def status(self, caller: Caller, args: dict[str, Any], reply: Responder) -> None:
        """A job's document; with ``debug``, for its owner and admins, also its story on this
        node (the part's stimuli and instructions: its own text is in them), and for admins
        the node's own story (other users' jobs are named in it)."""
        record = await self._find(args["job"])
        usage = self._jobs.usage_of(record.id)
        doc = shown_doc(record, {self._node: usage} if usage else None, self._lost())
        if not self._sees_all(caller, record):
            await reply.result(others_view(doc))
            return
        if args.get("debug"):
            doc["story"] = {self._node: self._jobs.job_story(record.id)}
            if self._is_admin(caller):
                doc["node_story"] = {self._node: self._jobs.node_story()}
        await reply.result(doc)

    def _lost(self) -> set[str]:
        """The nodes the observer judged lost: what they said last of a job is no longer true.
        For ``status`` only: a ``wait`` stream moves with the job's record, not with the
        nodes' states, so it would keep a node LOST after it came back."""
        return {name for name, state in self._cluster.states().items() if state is NodeState.LOST}

    async def wait(self, caller: Caller, args: dict[str, Any], reply: Responder) -> None:
        record = await self._find(args["job"])
        await self._stream_until_done(record, reply, full=self._sees_all(caller, record))

    async def cancel(self, caller: Caller, args: dict[str, Any], reply: Responder) -> None:
        record = await self._find(args["job"])
        self._check_owner(caller, record, "cancel")
        record = await self._jobs.cancel(record.id, by=user_name(caller.uid))
        await reply.result(shown_doc(record))

    async def nodes_list(self, caller: Caller, args: dict[str, Any], reply: Responder) -> None:
        if not args.get("watch"):
            await reply.result(await self._cluster.fresh())
            return
        async for nodes in self._cluster.watch():  # until the client goes away
            await reply.result(nodes)

    async def drain(self, caller: Caller, args: dict[str, Any], reply: Responder) -> None:
        await self._set_drain(caller, args["node"], True, reply)

    async def undrain(self, caller: Caller, args: dict[str, Any], reply: Responder) -> None:
        """The node takes jobs again; with ``gpu``: only that GPU, taken out as bad, is
        offered again (the node's drain, if any, stays)."""
        await self._set_drain(caller, args["node"], False, reply, gpu=args.get("gpu"))

    async def _set_drain(
        self, caller: Caller, node: str, drain: bool, reply: Responder, gpu: int | None = None
    ) -> None:
        if not self._is_admin(caller):
            raise PermissionDenied("only root and the admin group may drain nodes")
        if gpu is not None and gpu < 0:
            raise NotFound(f"no GPU {gpu}: GPU indices start at 0")
        await self._cluster.request_drain(node, drain, by=user_name(caller.uid), gpu=gpu)
        await reply.result(
            {"name": node, "drain": drain, **({"gpu": gpu} if gpu is not None else {})}
        )

    async def usage(self, caller: Caller, args: dict[str, Any], reply: Responder) -> None:
        """Node-, slot- and GPU-seconds and jobs per user and per account, of every job this
        node knows (the board's, and the history's ended ones within history.retention),
        for anyone who asks: sreport shows them to all on a shared cluster.  Names and
        numbers only: no job's id, arguments, environment or error text."""
        now = time.time()
        since, until = usage_window(args, now)
        records = self._registry.jobs()
        doc = await asyncio.to_thread(
            lambda: report(
                spans_of(records, group_namer()),
                since=since,
                until=until,
                user=args.get("user"),
                account=args.get("account"),
            )
        )
        await reply.result({**doc, "now": now, "retention": self._registry.retention})

    async def logs(self, caller: Caller, args: dict[str, Any], reply: Responder) -> None:
        """Every node's logs of the job: this node's files and live output, and the other
        nodes' fetched from their daemons, merged as they come (``local``: this node's
        only, as torchrun shows its own workers' output on each node)."""
        record = await self._find(args["job"])
        self._check_owner(caller, record, "read the logs of")
        if args.get("follow"):
            await reply.result({"lines": []})  # the client's first-reply bound: a job may be silent
        try:
            async with asyncio.TaskGroup() as sources:
                sources.create_task(self.local_logs(record.id, args, reply))
                followed = {self._node}
                while not args.get("local"):  # with --follow, nodes that join later too
                    for node in record.parts.keys() - followed:
                        followed.add(node)
                        sources.create_task(self._remote_logs(node, record.id, args, reply))
                    if record.outcome is not None or not args.get("follow"):
                        break
                    record = await self._registry.wait_change(record.id, record.version)
        except* PeerGone:  # the client went away: every source stopped with it
            raise PeerGone() from None
        await reply.end()

    async def local_logs(self, job_id: str, args: dict[str, Any], reply: Responder) -> None:
        """This node's logs of the job (no end marker: callers merge several sources).

        Read from the files at the pace the client takes them; with ``follow``, woken by
        new output until the job ended and its workers here are gone."""
        record = self._registry.get(job_id)
        reader = LogReader(
            self._config.log_dir,
            record.id,
            self._node,
            _LogFilter(args.get("rank"), args.get("attempt")),
        )
        if not args.get("follow"):
            await _send_all(reply, reader.new_lines(snapshot=True))
        else:
            with self._logs.follow(record.id) as wake:
                gone = asyncio.create_task(self._job_gone(record))
                try:
                    while not gone.done():
                        wake.clear()
                        await _send_all(reply, reader.new_lines())
                        await race(output=wake.wait(), gone=gone)
                finally:  # nothing outlives the request: the watch is awaited once cancelled
                    gone.cancel()
                    await asyncio.wait([gone])
                await _send_all(reply, reader.new_lines())
        await _send_lines(reply, reader.flush())

    async def _remote_logs(
        self, node: str, job_id: str, args: dict[str, Any], reply: Responder
    ) -> None:
        """Another node's logs of the job.  Without ``follow``, one try.  With it, asked
        again after a failure (its daemon did not know our key yet, or was stopped) with a
        growing pause, until its stream ended (the job ended there and its output is
        drained), or the job ended and the node is lost or never answered again: said
        once when it is unavailable and once when it is back, resuming after the lines
        already shown."""
        follow = _PeerFollow(node)
        while True:
            try:
                async for result in self._peers.logs(node, {**args, "job": job_id}):
                    await _send_lines(reply, follow.answered(result))
                return
            except ElasticdError as exc:
                record = self._registry.find(job_id)
                ended = record is None or record.outcome is not None
                if not args.get("follow") or not follow.failed(ended, self._cluster.alive(node)):
                    await _send_lines(
                        reply, [_notice(node, f"logs of node {node} unavailable: {exc}")]
                    )
                    return
                await _send_lines(reply, follow.unavailable(exc))
                await back_off(retry_pause(follow.failures - 1))

    async def _job_gone(self, record: JobRecord) -> None:
        while record.outcome is None:
            record = await self._registry.wait_change(record.id, record.version)
        await self._jobs.settled(record.id)

    async def _stream_until_done(self, record: JobRecord, reply: Responder, *, full: bool) -> None:
        """The job's document at every change until it ended (``full``: all of it, else
        as others see it)."""

        def shown(record: JobRecord) -> dict[str, Any]:
            return shown_doc(record) if full else others_view(shown_doc(record))

        await reply.result(shown(record))
        while record.outcome is None:
            record = await self._registry.wait_change(record.id, record.version)
            await reply.result(shown(record))
        await reply.end()


TERMINAL_STATES = frozenset(s.value for s in JobState if s.terminal)


def allocated(row: dict[str, Any], record: JobRecord, schedule: Schedule | None) -> dict[str, Any]:
    """A `list` row with the nodes the schedule gives the job, or why it waits."""
    if schedule is not None and row.get("state") not in TERMINAL_STATES:
        nodes = schedule.nodes.get(row["id"])
        row["allocated"] = len(nodes) if nodes is not None else 0
        reason = reason_of(schedule, record)
        if reason is not None:
            row["reason"] = reason.value
    return row


def queue_row(
    record: JobRecord, reason: str | None, position: int, schedule: Schedule | None
) -> dict[str, Any]:
    """A waiting job as `queue` shows it to everyone: what `list` shows, and the
    scheduler's keys (no arguments, environment or error text)."""
    spec = record.spec
    return {
        "position": position,
        "id": spec.id,
        "name": spec.name,
        "user": spec.user,
        "account": account_of(spec),
        "priority": spec.priority,
        "nnodes": spec.nnodes,
        "nnodes_step": spec.nnodes_step,
        "preemptible": spec.preemptible,
        "submitted": spec.created,
        "waiting_since": waiting_since(record),  # a job that ran before: since it stopped
        "state": record.state.value,
        "reason": reason,
        "preempted": schedule is not None and spec.id in schedule.preempted,
    }


def usage_window(args: Mapping[str, Any], now: float) -> tuple[float | None, float]:
    """A usage request's [since, until]: until at most now (what has not happened is not
    used yet); since, if given, before it."""
    since, until = args.get("since"), min(args.get("until", now), now)
    if since is not None and since >= until:
        raise InvalidSpec(
            f"usage: since must be before until and now (unix seconds: since {since:.0f}, "
            f"until {until:.0f})"
        )
    return since, until


def spans_of(records: Iterable[JobRecord], group_name: Callable[[int], str]) -> list[Span]:
    """Every job's usage spans; a record that cannot be read is left out (and logged), never
    the whole answer."""
    found: list[Span] = []
    for record in records:
        try:
            found += spans(record, group_name)
        except Exception:
            log.exception("job %s: its usage cannot be read", record.id)
    return found


class PeerCommands:
    """What another daemon may ask of this one (it is authenticated by its CURVE key)."""

    def __init__(self, commands: Commands) -> None:
        self._commands = commands

    async def __call__(self, caller: PeerCaller, request: Request, reply: Responder) -> None:
        if request.op != "logs":
            raise InvalidSpec(f"{request.op} is not a peer operation")
        if request.args.get("follow"):
            await reply.result({"lines": []})  # answered: a silent job is not a silent peer
        await self._commands.local_logs(request.args["job"], request.args, reply)
        await reply.end()


class _LogFilter:
    def __init__(self, rank: int | None, attempt: int | None) -> None:
        self.rank, self.attempt = rank, attempt

    def __call__(self, attempt: int, rank: int) -> bool:
        return (self.rank is None or rank == self.rank) and (
            self.attempt is None or attempt == self.attempt
        )


RETRY_FIRST, RETRY_MAX = 1.0, 10.0  # seconds between two asks of a peer's logs
RETRIES_AFTER_END = 3  # asks of a living peer after the job ended


def retry_pause(failures: int) -> float:
    """The pause before asking a peer again after ``failures`` failed asks in a row."""
    return min(RETRY_MAX, RETRY_FIRST * 2 ** min(failures, 8))


def keep_asking(ended: bool, alive: bool, failures: int) -> bool:
    """Whether a follower asks a peer for its logs again: always while the job runs; once it
    ended, a few times more while the node is alive (its output is not drained yet)."""
    return not ended or (alive and failures < RETRIES_AFTER_END)


class _PeerFollow:
    """A follower's asks of one peer for its logs: what it already passed on, the failed
    asks in a row, and whether it said the peer is unavailable."""

    def __init__(self, node: str) -> None:
        self.node, self.seen, self.failures, self.said = node, SeenLines(), 0, False
        self.stream_seen: dict[tuple, int] = {}  # lines of each source the current ask brought
        self.heard = False  # the current ask was answered

    def answered(self, result: Any) -> list[dict]:
        """The lines of a reply to pass on: those not passed on before, after word that
        the peer is back."""
        back = [_notice(self.node, f"logs of node {self.node} are back")] if self.said else []
        self.said, self.heard = False, True
        lines = result.get("lines") if isinstance(result, dict) else None
        return back + self.seen.fresh(self.stream_seen, lines or [])

    def failed(self, ended: bool, alive: bool) -> bool:
        """Counts a failed ask; whether to ask again.  The next ask is a new stream."""
        self.failures = 1 if self.heard else self.failures + 1
        self.stream_seen, self.heard = {}, False
        return keep_asking(ended, alive, self.failures - 1)

    def unavailable(self, exc: Exception) -> list[dict]:
        """Word that the peer is unavailable, once until it is back."""
        if self.said:
            return []
        self.said = True
        return [
            _notice(
                self.node,
                f"logs of node {self.node} unavailable for now ({exc}); "
                f"asking again until the job ends",
            )
        ]


def _notice(node: str, text: str) -> dict:
    return {
        "node": node,
        "rank": None,
        "attempt": None,
        "stream": "err",
        "text": f"elasticd: {text}",
    }


async def _send_lines(reply: Responder, lines: list[dict]) -> None:
    if lines:
        await reply.result({"lines": lines})


async def _send_all(reply: Responder, batches: Iterable[list[dict]]) -> None:
    for lines in batches:
        await _send_lines(reply, lines)
