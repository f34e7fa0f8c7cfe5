"""A private daemon: one per node of one job, started by that node's ``elasticrun`` for a
torchrun line run once per node where no elasticd is installed (docs/elasticrun.md, "Where
no elasticd runs").  ``elasticd --private DIR --private-fd FD``: DIR is the job's directory
that elasticrun made (ctl/elasticctl/private.py says what is in it), FD one end of a socket
pair whose other end elasticrun holds.

What makes it private:

- **One job.**  Before this node takes part in anything, the job's nodes agree on the job's
  id in the store (a compare-and-set of a signed claim: the first node's id wins); that node
  submits the job once it is up, the others wait for it.  The store holds the job's settings
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
from typing import Any

from elasticd.aio import race
from elasticd.cluster.service import NodeService
from elasticd.config import DaemonConfig
from elasticd.control.commands import spec_from_request
from elasticd.control.server import Caller
from elasticd.core.model import JobSpec, NodeState
from elasticd.core.records import JobRecord
from elasticd.errors import ElasticdError
from elasticd.jobs.board import JOB_ID, new_job_id
from elasticd.jobs.registry import JobRegistry
from elasticd.shell.node import NodeShell
from elasticd.store.base import Store
from elasticd.store.signing import Signer, open_or_refuse

log = logging.getLogger("elasticd")

STORE_LOST_AFTER = 20.0  # seconds the store may not answer before the job is given up here
LINGER = 30.0  # seconds the store's host waits for the other nodes' parts to end
JOB_WIDE = ("min_nodes", "max_nodes", "nproc_per_node", "max_restarts", "in_place", "spares")


class PrivateError(ElasticdError):
    code = "private"


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
        self.submits = False  # this node won the claim: it submits the job
        self.own: JobSpec | None = None  # the job as this node's line has it
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
        key = f"{root}/elasticrun/claim"
        mine = new_job_id()
        swapped, held = await store.compare_set(key, None, signer.seal(key, {"job": mine}))
        self.job_id = mine if swapped else self._open_id(signer, key, held)
        self.submits = swapped
        self.own = spec_from_request(
            self.request,
            Caller(os.getuid(), os.getgid(), os.getpid()),
            config,
            job_id=self.job_id,
            node=node,
            now=time.time(),
        )

    @staticmethod
    def _open_id(signer: Signer, key: str, raw: bytes | None) -> str:
        why: list[str] = []
        job = open_or_refuse(signer, key, raw, _job_id, lambda key, reason: why.append(reason))
        if job is None:
            raise PrivateError(
                f"the job's record in the store ({key}) does not open with this node's key "
                f"({'; '.join(why) or 'none'}): every node of a job needs the same key "
                "(--rdzv-conf key_file=FILE), and a rendezvous id that no other job uses"
            )
        return job

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
                job=self._join(store, signer, root, node_shell),
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

    async def _join(self, store: Store, signer: Signer, root: str, node_shell: NodeShell) -> None:
        assert self.own is not None
        key = f"{root}/elasticrun/job"
        if self.submits:
            published = dataclasses.replace(self.own, argv=self.own.argv[:1], env={})
            await node_shell.submit(published)
            await store.set(key, signer.seal(key, {"job": self.job_id}))
            return
        if not await store.wait_for(key, self.own.join_timeout):
            raise PrivateError(
                f"job {self.job_id} was claimed but not submitted within "
                f"{self.own.join_timeout:g} s (the node that claimed it is gone?)"
            )
        record = await node_shell.fetch(self.job_id)
        if record is None:
            raise PrivateError(f"job {self.job_id} is not on the store's board")
        self.check(record)

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
