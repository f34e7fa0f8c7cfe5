"""A private daemon: one per node of one job, started by that node's ``elasticrun`` for a
torchrun line run once per node where no elasticd is installed (docs/elasticrun.md, "Where
no elasticd runs").  ``elasticd --private DIR --private-fd FD``: DIR is the job's directory
that elasticrun made (ctl/elasticctl/private.py says what is in it), FD one end of a socket
pair whose other end elasticrun holds.

What makes it private:

- **One job.**  Before this node takes part in anything, the job's nodes agree on the job's
  id in the store (a compare-and-set of a signed claim: the first node's id wins); that node
  submits the job once it is up, the others wait for it.  A claim whose node gave up before
  its submit (Ctrl-C, a failed start) is withdrawn, and one that stood CLAIM_STALE seconds
  without it (its node SIGKILLed, before or during its submit) is taken over: another node
  submits the job under the same id, so a run id is never dead for the store's life.  The store holds the job's settings
  (nodes, workers, restarts) and its program's name, never its arguments or environment.
- **Its own command line.**  Every node runs what its own elasticrun was given (argv,
  interpreter, working directory, environment: each node's workers inherit that node's, as
  torchrun's do), whatever a record in the store says: a job it did not agree on cannot
  start here, and a job's record cannot make it run another command (the ``lens``).  A job
  whose settings differ from this node's line is refused, saying which.
- **Its elasticrun's life.**  It tells elasticrun the job's id on the channel, and stops when
  elasticrun closes it or dies (EOF, SIGKILL included): its workers are stopped and it
  leaves the job, which goes on without this node.  The node that hosts the job's TCPStore
  first waits, once the job has ended, until every other node's part of it ended too (30 s at
  most).  A store that stays unreachable for STORE_LOST_AFTER seconds ends it too, saying
  why: a job on c10d cannot outlive the node that hosts its store (as with torchrun).
- **Nothing left.**  Its directory goes when it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from elasticd.aio import race
from elasticd.cluster.service import NodeService
from elasticd.config import DaemonConfig
from elasticd.control.commands import spec_from_request
from elasticd.control.server import Caller
from elasticd.core.model import JobSpec, NodeState
from elasticd.core.records import JobRecord
from elasticd.errors import ElasticdError
from elasticd.jobs.board import JOB_ID, IdTaken, new_job_id
from elasticd.jobs.registry import JobRegistry
from elasticd.shell.node import NodeShell
from elasticd.store.base import Store
from elasticd.store.signing import Signer, open_or_refuse

log = logging.getLogger("elasticd")

STORE_LOST_AFTER = 20.0  # seconds the store may not answer before the job is given up here
LINGER = 30.0  # seconds the store's host waits for the other nodes' parts to end
CLAIM_STALE = 30.0  # seconds a claim may stand without its node's submit before it is taken over
CLAIM_POLL = 1.0  # seconds between a waiting node's looks at the claim
WITHDRAW_TIMEOUT = 5.0  # seconds a node that gives up waits for the store to withdraw its claim
OPEN, SUBMITTING, WITHDRAWN = "open", "submitting", "withdrawn"  # a claim's states
JOB_WIDE = ("min_nodes", "max_nodes", "nproc_per_node", "max_restarts", "in_place", "spares")


class PrivateError(ElasticdError):
    code = "private"


@dataclass(frozen=True)
class Claim:
    """The job's id and the node that is to submit it, as the store holds them: OPEN until
    that node, up, is about to submit (SUBMITTING), or WITHDRAWN when it gave up.
    The id stays whichever node takes the claim over: the nodes that wait for the job know
    it before it is on the board (their lens runs that id only)."""

    job: str
    node: str
    state: str


def free(claim: Claim, standing: float, stale_after: float) -> bool:
    """Whether a node may take over ``claim``, which it has seen unchanged for ``standing``
    seconds (and the job not submitted meanwhile): one withdrawn, or one that stood
    ``stale_after``, open or submitting (its node died before its submit, or in it: SIGKILL
    leaves no time to withdraw).  A bound, not the claimer's liveness: it claimed before it
    joined the cluster, so there is no heartbeat of it to miss.  Taking over is a
    compare-and-set from the very record seen, as the claim's node moving it to SUBMITTING
    is: of two nodes that judge at once, and of a slow node and the one that judged it dead,
    one wins and the others wait for it.  A live node slower than ``stale_after`` to start
    loses its turn to submit; one slower than that in its submit finds the job submitted by
    the node that took over (or that node finds its), and runs it: no more."""
    return claim.state == WITHDRAWN or standing >= stale_after


class Private:
    """This daemon's job and the channel to the elasticrun that started it."""

    def __init__(self, directory: str, fd: int) -> None:
        self.directory = directory
        self.channel = socket.socket(fileno=fd)
        self.channel.set_inheritable(False)
        with open(os.path.join(directory, "job.json"), encoding="utf-8") as file:
            doc = json.load(file)
        self.request: dict[str, Any] = doc["request"]
        self.run_id: str = doc["run_id"]
        self.keyless: bool = doc["keyless"]
        self.job_id = ""
        self.submits = False  # this node's claim is the one held: it submits the job
        self.submitted = False  # its claim went SUBMITTING: it is the job's, never withdrawn
        self.own: JobSpec | None = None  # the job as this node's line has it
        self._held: bytes | None = None  # the claim as this node last saw it in the store
        self._held_since = 0.0  # when it first saw it so (time.monotonic())
        self._node = ""
        self.code = 0
        self.orphaned = asyncio.Event()
        self._lost: asyncio.TimerHandle | None = None

    # -- what this node runs ------------------------------------------------------------------

    def gpus(self) -> tuple[str, ...] | None:
        """The GPUs elasticrun was given (CUDA_VISIBLE_DEVICES: a Slurm step's, a container's),
        as they name them; None when it was not set (then the node's own)."""
        visible = self.request.get("env", {}).get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return None
        return tuple(name.strip() for name in visible.split(",") if name.strip())

    def spec(self, spec: JobSpec) -> JobSpec:
        """What this node runs of ``spec``: its own line's command, as its own user."""
        own = self.own
        if own is None or spec.id != self.job_id:
            raise PrivateError(f"this private daemon runs job {self.job_id or '(none yet)'} only")
        return dataclasses.replace(
            spec,
            argv=own.argv,
            kind=own.kind,
            python=own.python,
            workdir=own.workdir,
            env=own.env,
            uid=own.uid,
            gid=own.gid,
            user=own.user,
        )

    def worker_env(self, spec: JobSpec) -> Mapping[str, str]:
        """torchrun's TORCHELASTIC_RUN_ID is the rendezvous id."""
        return {"TORCHELASTIC_RUN_ID": self.run_id}

    # -- the job's id, agreed in the store ----------------------------------------------------

    async def claim(
        self, store: Store, signer: Signer, root: str, config: DaemonConfig, node: str
    ) -> None:
        """Agree on the job's id before this node takes part in anything: the first node's
        claim wins."""
        self._node = node
        await self._take(store, signer, f"{root}/elasticrun/claim", None)
        self.own = spec_from_request(
            self.request,
            Caller(os.getuid(), os.getgid(), os.getpid()),
            config,
            job_id=self.job_id,
            node=node,
            now=time.time(),
        )

    async def _take(self, store: Store, signer: Signer, key: str, expected: bytes | None) -> None:
        """Claim the job for this node in place of ``expected`` (None: no claim yet), or hold
        the claim that is there instead; one withdrawn is taken in turn.  The job's id is the
        first claim's, kept by every claim that takes its place."""
        job = self.job_id or new_job_id()
        while True:
            mine = Claim(job, self._node, OPEN)
            sealed = signer.seal(key, dataclasses.asdict(mine))
            swapped, held = await store.compare_set(key, expected, sealed)
            claim = mine if swapped else self._open_claim(signer, key, held)
            if swapped or claim.state != WITHDRAWN:
                self._hold(claim, held, submits=swapped)
                return
            expected, job = held, claim.job

    def _hold(self, claim: Claim, raw: bytes | None, *, submits: bool) -> None:
        if self.job_id and claim.job != self.job_id:  # its id went to this node's lens
            raise PrivateError(f"the claim of job {self.job_id} became job {claim.job}'s")
        self._held, self._held_since = raw, time.monotonic()
        self.job_id, self.submits = claim.job, submits

    @staticmethod
    def _open_claim(signer: Signer, key: str, raw: bytes | None) -> Claim:
        why: list[str] = []
        claim = open_or_refuse(signer, key, raw, _claim, lambda key, reason: why.append(reason))
        if claim is None:
            raise PrivateError(
                f"the job's record in the store ({key}) does not open with this node's key "
                f"({'; '.join(why) or 'none'}): every node of a job needs the same key "
                "(--rdzv-conf key_file=FILE), and a rendezvous id that no other job uses"
            )
        return claim

    async def withdraw(self, store: Store, signer: Signer, root: str) -> None:
        """This node's claim, if it holds one it never took to its submit: the daemon is
        stopping before the job started (elasticrun gone, a failed start), and a claim left
        there would hold every node of this run id, this one run again included, until the
        claim is judged dead.  Only this node's own record is replaced (a compare-and-set),
        never a claim that took its place."""
        if not self.submits or self.submitted or self._held is None:
            return
        key = f"{root}/elasticrun/claim"
        withdrawn = signer.seal(key, dataclasses.asdict(Claim(self.job_id, self._node, WITHDRAWN)))
        try:
            async with asyncio.timeout(WITHDRAW_TIMEOUT):
                await store.compare_set(key, self._held, withdrawn)
        except (ElasticdError, TimeoutError) as exc:
            log.warning("could not withdraw the claim of job %s: %s", self.job_id, exc)

    async def serve(
        self,
        *,
        store: Store,
        signer: Signer,
        root: str,
        node_shell: NodeShell,
        registry: JobRegistry,
        nodes: NodeService,
        stop: asyncio.Event,
        node: str,
        endpoint: str,
        hosts_store: bool,
    ) -> None:
        """Once the daemon is up: submit the job (the claim's winner) or find it, tell
        elasticrun, and stop when elasticrun has gone (the store's host lingers first)."""
        try:
            name, joined = await race(
                job=self.join_job(store, signer, root, node_shell),
                orphaned=self.orphaned.wait(),
            )
            if name == "job":
                joined.result()
                self.say(
                    {
                        "job": self.job_id,
                        "node": node,
                        "store": endpoint,
                        "hosts_store": hosts_store,
                        "submitted": self.submits,
                    }
                )
                await self.orphaned.wait()
                record = registry.find(self.job_id)
                if hosts_store and record is not None and record.outcome is not None:
                    await self.linger(node_shell, registry, nodes)
        except ElasticdError as exc:
            self.fail(str(exc))
        except Exception as exc:  # the daemon must stop, and say why, whatever it was
            log.exception("private job: unexpected error")
            self.fail(f"unexpected error: {exc!r}")
        finally:
            stop.set()

    async def join_job(
        self, store: Store, signer: Signer, root: str, node_shell: NodeShell
    ) -> None:
        """Submit the job where this node's claim won, else find it on the board and check
        that its settings are this line's."""
        await self.agree(store, signer, root)
        assert self.own is not None
        if self.submitted:
            key = f"{root}/elasticrun/job"
            published = dataclasses.replace(self.own, argv=self.own.argv[:1], env={})
            try:
                await node_shell.submit(published)
            except IdTaken:  # the claim this node took over, or that took over its, was slow
                self.submits = False
            # the job's key, set again where the other node submitted it and died before
            await store.set(key, signer.seal(key, {"job": self.job_id}))
            if self.submits:
                return
        record = await node_shell.fetch(self.job_id)
        if record is None:
            raise PrivateError(f"job {self.job_id} is not on the store's board")
        self.check(record)

    async def agree(self, store: Store, signer: Signer, root: str) -> None:
        """Until this node is the one to submit the job (its claim went SUBMITTING) or the
        job was submitted: a node that waits looks at the claim every CLAIM_POLL seconds and
        takes it over when it is ``free``."""
        assert self.own is not None
        claim_key, job_key = f"{root}/elasticrun/claim", f"{root}/elasticrun/job"
        stale_after = min(CLAIM_STALE, self.own.join_timeout / 2)
        deadline = time.monotonic() + self.own.join_timeout
        while True:
            if self.submits:
                mine = Claim(self.job_id, self._node, SUBMITTING)
                submitting = signer.seal(claim_key, dataclasses.asdict(mine))
                swapped, held = await store.compare_set(claim_key, self._held, submitting)
                if swapped:
                    self._held, self.submitted = submitting, True
                    return
                await self._follow(store, signer, claim_key, held, stale_after)
                continue
            left = deadline - time.monotonic()
            if await store.wait_for(job_key, max(0.0, min(CLAIM_POLL, left))):
                return
            if left <= 0:
                raise PrivateError(
                    f"job {self.job_id} was claimed but not submitted within "
                    f"{self.own.join_timeout:g} s (the node that claimed it is gone?)"
                )
            held = await store.get(claim_key)
            await self._follow(store, signer, claim_key, held, stale_after)

    async def _follow(
        self, store: Store, signer: Signer, key: str, held: bytes | None, stale_after: float
    ) -> None:
        """The claim now in the store (``held``): followed if it changed, taken over if it is
        ``free``."""
        if held is None:  # deleted under it: claimed anew
            await self._take(store, signer, key, None)
            return
        claim = self._open_claim(signer, key, held)
        if held != self._held:
            self._hold(claim, held, submits=False)
        if free(claim, time.monotonic() - self._held_since, stale_after):
            await self._take(store, signer, key, held)

    def check(self, record: JobRecord) -> None:
        """The job's settings must be this node's line's."""
        assert self.own is not None
        if record.outcome is not None:
            raise PrivateError(
                f"rendezvous id {self.run_id!r} already ran to its end here (job {record.id}, "
                f"{record.state.value}): give this run a new --rdzv-id"
            )
        differ = [
            f"{name} {getattr(self.own, name)!r} here, {getattr(record.spec, name)!r} in the job"
            for name in JOB_WIDE
            if getattr(self.own, name) != getattr(record.spec, name)
        ]
        if differ:
            raise PrivateError(
                f"this node's command line differs from job {record.id}'s (submitted by "
                f"{record.spec.submitted_on}): " + "; ".join(differ)
            )

    async def linger(
        self, node_shell: NodeShell, registry: JobRegistry, nodes: NodeService
    ) -> None:
        """Until every other node's part of the ended job has ended (or its node is lost):
        they need the store this node hosts to learn the outcome.  LINGER at most.  The job
        is read from the board at each change here and each heartbeat's time: the follower
        reads the board again after a gap in its log, but not the parts of a job that ended."""
        deadline = asyncio.get_running_loop().time() + LINGER
        while True:
            await node_shell.fetch(self.job_id)
            record = registry.find(self.job_id)
            if record is None or _all_ended(record, nodes.states()):
                return
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                log.warning(
                    "job %s: some nodes' parts had not ended after %g s", self.job_id, LINGER
                )
                return
            await race(
                changed=registry.wait_change(self.job_id, record.version),
                beat=asyncio.sleep(min(left, nodes.interval)),
            )

    # -- the channel to elasticrun ------------------------------------------------------------

    async def supervise(self, run: Callable[[], Any], serving: Callable[[], bool]) -> int:
        """Run the daemon (``run``) while watching the channel: elasticrun gone before the
        daemon serves cancels its start-up; after, ``serve`` stops it."""
        main = asyncio.current_task()
        assert main is not None

        def gone() -> None:
            if not serving():
                main.cancel()

        watcher = asyncio.create_task(self._watch(gone))
        try:
            code = await run()
        except asyncio.CancelledError:
            if not self.orphaned.is_set():
                raise
            log.warning("elasticrun is gone: stopped before the job started")
            return 1
        finally:
            watcher.cancel()
        return code or self.code

    async def _watch(self, gone: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        self.channel.setblocking(False)
        while True:
            try:
                data = await loop.sock_recv(self.channel, 4096)
            except OSError:
                data = b""
            if not data:
                break
        self.orphaned.set()
        gone()

    def say(self, doc: Mapping[str, Any]) -> None:
        try:
            self.channel.send(json.dumps(doc).encode() + b"\n")
        except OSError:  # elasticrun is gone (or not reading): nobody to tell
            pass

    def fail(self, message: str) -> None:
        log.error("%s", message)
        self.say({"error": message})
        self.code = 1

    def store_health(self, ok: bool, problem: str, stop: asyncio.Event, endpoint: str) -> None:
        """A store that does not answer for STORE_LOST_AFTER seconds ends this node's job."""
        if ok:
            if self._lost is not None:
                self._lost.cancel()
                self._lost = None
            return
        if self._lost is None:
            self._lost = asyncio.get_running_loop().call_later(
                STORE_LOST_AFTER, self._store_lost, problem, stop, endpoint
            )

    def _store_lost(self, problem: str, stop: asyncio.Event, endpoint: str) -> None:
        self.fail(
            f"the job's store at {endpoint} has not answered for {STORE_LOST_AFTER:g} s "
            f"({problem}): the node that hosts it is gone or cut off, and a job on c10d "
            "cannot go on without it (as with torchrun); --rdzv-backend etcd has no such node"
        )
        stop.set()

    def remove_directory(self) -> None:
        """The job's directory, last of all (nothing of the daemon is left)."""
        self.channel.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def _claim(body: Any) -> Claim:
    state, node = body.get("state", OPEN), body.get("node", "")
    if state not in (OPEN, SUBMITTING, WITHDRAWN) or not isinstance(node, str):
        raise ValueError(f"not a claim: {body!r}")
    return Claim(_job_id(body), node, state)


def _job_id(body: Any) -> str:
    job = body["job"]
    if not isinstance(job, str) or not JOB_ID.match(job):
        raise ValueError(f"not a job id: {job!r}")
    return job


def _all_ended(record: JobRecord, states: Mapping[str, NodeState]) -> bool:
    return all(
        not part.state.active or states.get(node) is NodeState.LOST
        for node, part in record.parts.items()
    )
