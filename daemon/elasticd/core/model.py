"""Pure data: jobs, workers, nodes, and the state tables they change by.  No I/O here; JSON
in and out with a schema version.

Every state change of a job, a node's part of a job, a worker and a node goes through its
table (h11's ``_state.py`` in small): a move the table does not list raises
IllegalTransition and the caller changes nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeGuard

# The tables' home is tables.py; the model re-exports them beside the tables it builds.
from elasticd.core.tables import IllegalTransition as IllegalTransition
from elasticd.core.tables import StateTable as StateTable
from elasticd.errors import InvalidSpec
from elasticd.rendezvous.state import RendezvousSettings
from elasticd.wire import protocol

SCHEMA = 1
GPU = protocol.GPU
CPU = protocol.CPU
AUTO = protocol.AUTO
KINDS = ("script", "module", "exec")
MAX_TIMEOUT = (
    365 * 24 * 3600.0
)  # a year: longer than any job waits, shorter than any clock overflows
MAX_COUNT = 1_000_000  # restarts, nodes: beyond any cluster
MAX_NPROC = 4096
MAX_NAME = 256
MAX_ROLE = 64
MAX_PRIORITY = 1_000_000  # |priority|: the config bounds what each user may ask
DEFAULT_ROLE = "default"  # torchrun's --role
# Fields a daemon of the previous version does not know: left out of a spec's JSON while
# they hold their default, so that it can still read every ordinary job.
_OMITTED_AT_DEFAULT = (
    "hang_timeout",
    "role",
    "master_port",
    "priority",
    "account",
    "preemptible",
    "nnodes_step",
    "spares",
    "warm_restart",
)


class JobState(enum.StrEnum):
    PENDING = "PENDING"  # no node has joined yet
    RENDEZVOUS = "RENDEZVOUS"  # nodes are forming its first round
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"  # it ran, and a new round is forming (after a failure, a
    #                              membership change, or while every node it had is gone)
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


_JOB_ENDS = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)
# A daemon sees other nodes' parts when the board delivers them, so it may skip states (a
# daemon that starts while a job restarts sees it PENDING, then RESTARTING); what it never
# sees is a job that ran going back to PENDING or RENDEZVOUS, or a job that ended going on.
JOB_STATES = StateTable(
    "a job",
    {
        JobState.PENDING: (JobState.RENDEZVOUS, JobState.RUNNING, JobState.RESTARTING, *_JOB_ENDS),
        JobState.RENDEZVOUS: (JobState.PENDING, JobState.RUNNING, JobState.RESTARTING, *_JOB_ENDS),
        JobState.RUNNING: (JobState.RESTARTING, *_JOB_ENDS),
        JobState.RESTARTING: (JobState.RUNNING, *_JOB_ENDS),
        **{end: () for end in _JOB_ENDS},
    },
)


class PartState(enum.StrEnum):
    """One node's share of a job (written by that node's agent)."""

    RENDEZVOUS = "RENDEZVOUS"  # waiting for the job's nodes
    RUNNING = "RUNNING"  # workers up
    RESTARTING = (
        "RESTARTING"  # stopping workers / re-forming after a failure or a membership change
    )
    BARRIER = "BARRIER"  # local workers succeeded, waiting for the other nodes
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"  # stopped because the job ended or the daemon shut down
    LEFT = "LEFT"  # the node left the job (drain) and the job went on without it

    @property
    def active(self) -> bool:
        return self in (
            PartState.RENDEZVOUS,
            PartState.RUNNING,
            PartState.RESTARTING,
            PartState.BARRIER,
        )


_PART_ENDS = (PartState.SUCCEEDED, PartState.FAILED, PartState.STOPPED, PartState.LEFT)
PART_STATES = StateTable(
    "a node's part of a job",
    {
        PartState.RENDEZVOUS: (
            PartState.RUNNING,
            PartState.FAILED,
            PartState.STOPPED,
            PartState.LEFT,
        ),
        PartState.RUNNING: (
            PartState.RESTARTING,
            PartState.BARRIER,
            PartState.FAILED,
            PartState.STOPPED,
            PartState.LEFT,
            PartState.SUCCEEDED,
        ),  # the last node at the exit barrier waits for nobody
        PartState.RESTARTING: (
            PartState.RUNNING,
            PartState.FAILED,
            PartState.STOPPED,
            PartState.LEFT,
        ),
        PartState.BARRIER: (PartState.RESTARTING, *_PART_ENDS),
        **{end: () for end in _PART_ENDS},
    },
)
# A node whose part ended may take the job again later (it left, or stopped with its
# daemon, and the job went on): that is a new agent's part, which starts at RENDEZVOUS.
NEW_PART = PartState.RENDEZVOUS


class WorkerState(enum.StrEnum):
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


WORKER_STATES = StateTable(
    "a worker",
    {
        WorkerState.INIT: (WorkerState.HEALTHY, WorkerState.FAILED),  # FAILED: it could not start
        WorkerState.HEALTHY: (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED),
        WorkerState.SUCCEEDED: (),
        WorkerState.FAILED: (),
        WorkerState.STOPPED: (),
    },
)


class NodeState(enum.StrEnum):
    """A node as another node sees it (its record and its heartbeat)."""

    UP = "up"
    DRAINING = "draining"  # takes no new job; its jobs move off it through new rounds
    DRAINED = "drained"  # draining, and no job left
    BLACKLISTED = (
        "blacklisted"  # its workers kept failing: out of new rounds until its cooldown ends
    )
    LOST = "lost"  # its heartbeat stood still (liveness.silent)


# Observed once per heartbeat duty, so a short stay in a state may go unseen; any state may
# turn LOST and come back from it, and any may be blacklisted (a drained node's last failure
# may be seen late) and come back to what it was.
NODE_STATES = StateTable(
    "a node",
    {
        NodeState.UP: (
            NodeState.DRAINING,
            NodeState.DRAINED,
            NodeState.BLACKLISTED,
            NodeState.LOST,
        ),
        NodeState.DRAINING: (
            NodeState.DRAINED,
            NodeState.UP,
            NodeState.BLACKLISTED,
            NodeState.LOST,
        ),
        NodeState.DRAINED: (
            NodeState.UP,
            NodeState.BLACKLISTED,
            NodeState.LOST,
        ),  # it takes no job: never draining again first
        NodeState.BLACKLISTED: (
            NodeState.UP,
            NodeState.DRAINING,
            NodeState.DRAINED,
            NodeState.LOST,
        ),
        NodeState.LOST: (
            NodeState.UP,
            NodeState.DRAINING,
            NodeState.DRAINED,
            NodeState.BLACKLISTED,
        ),
    },
)


@dataclass(frozen=True)
class JobSpec:
    """What to run, as whom, where and how elastically.  Fixed at submit."""

    id: str
    argv: tuple[str, ...]
    python: str
    workdir: str
    uid: int
    gid: int
    user: str
    name: str = ""
    kind: str = "script"
    env: Mapping[str, str] = field(default_factory=dict)
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int | str = 1
    max_restarts: int = RendezvousSettings.max_restarts
    join_timeout: float = RendezvousSettings.join_timeout
    last_call_timeout: float = RendezvousSettings.last_call_timeout
    exit_barrier_timeout: float = 300.0
    in_place: bool = False  # survivors keep their processes across rounds (elasticd.elastic)
    rejoin_timeout: float = 60.0  # in place: how long a survivor may take to ask for its new place
    spares: int = 0  # in place: warm workers per node kept beside the placed ones (free slots)
    hang_timeout: float = 0.0  # seconds without progress after which ranks are hung (0: never)
    nodes: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    submitted_on: str = ""
    created: float = 0.0
    role: str = DEFAULT_ROLE  # the workers' ROLE_NAME
    master_port: int = 0  # MASTER_PORT of every round; 0: a free port on group rank 0's node
    priority: int = 0  # the scheduler's first key (bounded per user and group by the config)
    account: str = (
        ""  # whom its use is charged to: a group of the user ("": the user's primary group)
    )
    preemptible: bool = False  # may be stopped below its min and requeued for a job ahead of it
    nnodes_step: int = (
        1  # its node count is a multiple of this (world sizes that keep batch maths valid)
    )
    checkpoint_dir: str = ""  # where complete checkpoints are also written ("": memory only)
    keep_checkpoints: int = 3  # how many of them stay there
    checkpoint_memory: int = 0  # bytes its checkpoints may hold on a node (0: the node's default)
    warm_restart: bool = False  # an interpreter per slot waits, torch imported, for a restart

    def __post_init__(self) -> None:
        validate(self)

    @property
    def nnodes(self) -> str:
        return f"{self.min_nodes}:{self.max_nodes}"

    def command(self) -> list[str]:
        """The argv a worker execs: what torchrun would run for the same arguments."""
        if self.kind == "exec":
            return list(self.argv)
        if self.kind == "module":
            return [self.python, "-m", *self.argv]
        return [self.python, *self.argv]

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["env"] = dict(self.env)
        doc["schema"] = SCHEMA
        for name in _OMITTED_AT_DEFAULT:
            if doc[name] == JobSpec.__dataclass_fields__[name].default:
                del doc[name]
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> JobSpec:
        if not isinstance(doc, Mapping) or doc.get("schema") != SCHEMA:
            raise InvalidSpec("job spec has an unknown schema version")
        fields = {k: v for k, v in doc.items() if k != "schema"}
        for name in ("argv", "nodes", "exclude"):
            if isinstance(fields.get(name), list):
                fields[name] = tuple(fields[name])
        try:
            return cls(**fields)
        except TypeError as exc:
            raise InvalidSpec(f"job spec is malformed: {exc}") from None


def validate(spec: JobSpec) -> None:
    """Raise InvalidSpec naming the first field that is wrong.  Pure: no file-system checks."""

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise InvalidSpec(message)

    need(
        bool(spec.argv) and all(_is_text(a) for a in spec.argv) and spec.argv[0] != "",
        "argv must be a non-empty list of strings without NUL bytes",
    )
    need(spec.kind in KINDS, f"kind must be one of {', '.join(KINDS)}")
    need(
        _is_text(spec.python) and (spec.kind == "exec" or spec.python.startswith("/")),
        "python must be an absolute path",
    )
    need(
        _is_text(spec.workdir) and spec.workdir.startswith("/"), "workdir must be an absolute path"
    )
    need(
        isinstance(spec.env, Mapping)
        and all(_is_text(k) and _is_text(v) and k and "=" not in k for k, v in spec.env.items()),
        "env must map names (without '=' or NUL) to strings without NUL bytes",
    )
    need(
        _is_text(spec.name) and len(spec.name) <= MAX_NAME and _is_text(spec.user),
        f"name must be text of at most {MAX_NAME} characters",
    )
    need(
        _is_int(spec.min_nodes)
        and _is_int(spec.max_nodes)
        and 1 <= spec.min_nodes <= spec.max_nodes <= MAX_COUNT,
        f"nnodes must be N or MIN:MAX with 1 <= MIN <= MAX <= {MAX_COUNT}, "
        f"got {spec.min_nodes}:{spec.max_nodes}",
    )
    need(
        spec.nproc_per_node in protocol.NPROC_WORDS
        or (_is_int(spec.nproc_per_node) and 1 <= spec.nproc_per_node <= MAX_NPROC),
        f"nproc_per_node must be one of N, {', '.join(protocol.NPROC_WORDS)} "
        f"(N an integer from 1 to {MAX_NPROC})",
    )
    need(
        _is_int(spec.max_restarts) and 0 <= spec.max_restarts <= MAX_COUNT,
        f"max_restarts must be from 0 to {MAX_COUNT}",
    )
    need(isinstance(spec.in_place, bool), "in_place must be true or false")
    need(
        _is_int(spec.spares) and 0 <= spec.spares <= MAX_NPROC,
        f"spares must be from 0 to {MAX_NPROC}",
    )
    need(
        not spec.spares or spec.in_place,
        "spares are warm workers of an --in-place job: add --in-place",
    )
    need(isinstance(spec.warm_restart, bool), "warm_restart must be true or false")
    need(
        not (spec.warm_restart and spec.in_place),
        "--warm-restart is for jobs whose restarts start every worker anew; an --in-place "
        "job keeps its survivors' processes (and --spares keeps warm workers for it)",
    )
    need(
        not spec.warm_restart or spec.kind != "exec",
        "--warm-restart keeps Python interpreters waiting: it needs a script or a module "
        "(not --no-python)",
    )
    for name, positive in (
        ("join_timeout", True),
        ("exit_barrier_timeout", True),
        ("rejoin_timeout", True),
        ("last_call_timeout", False),
        ("hang_timeout", False),
    ):
        value = getattr(spec, name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        need(
            number and (value > 0 if positive else value >= 0) and value <= MAX_TIMEOUT,
            f"{name} must be {'more than 0' if positive else '0 or more'} and at most "
            f"{MAX_TIMEOUT:.0f} seconds, got {value!r}",
        )
    need(
        all(_is_text(n) and n for n in spec.nodes + spec.exclude),
        "nodes and exclude must be node names",
    )
    need(
        _is_text(spec.role) and 0 < len(spec.role) <= MAX_ROLE,
        f"role must be non-empty text of at most {MAX_ROLE} characters",
    )
    need(
        _is_int(spec.master_port) and 0 <= spec.master_port <= 65535,
        f"master_port must be from 0 (a free port every round) to 65535, got {spec.master_port!r}",
    )
    need(
        not (spec.in_place and spec.master_port == 65535),
        "master_port in place uses the port and the one after it: at most 65534",
    )
    _validate_sharing(spec, need)
    need(
        _is_text(spec.checkpoint_dir)
        and (not spec.checkpoint_dir or spec.checkpoint_dir.startswith("/")),
        "checkpoint_dir must be an absolute path",
    )
    need(
        _is_int(spec.keep_checkpoints) and 1 <= spec.keep_checkpoints <= MAX_COUNT,
        f"keep_checkpoints must be from 1 to {MAX_COUNT}, got {spec.keep_checkpoints!r}",
    )
    need(
        _is_int(spec.checkpoint_memory) and 0 <= spec.checkpoint_memory < 1 << 60,
        f"checkpoint_memory must be a number of bytes, got {spec.checkpoint_memory!r}",
    )


def _validate_sharing(spec: JobSpec, need: Callable[[bool, str], None]) -> None:
    """The scheduler's fields: a priority within bounds, an account name, a node-count step
    that leaves at least one count between min and max."""
    need(
        _is_int(spec.priority) and -MAX_PRIORITY <= spec.priority <= MAX_PRIORITY,
        f"priority must be an integer from {-MAX_PRIORITY} to {MAX_PRIORITY}, got {spec.priority!r}",
    )
    need(
        _is_text(spec.account)
        and len(spec.account) <= MAX_NAME
        and not any(c.isspace() for c in spec.account),
        f"account must be a group name of at most {MAX_NAME} characters",
    )
    need(isinstance(spec.preemptible, bool), "preemptible must be true or false")
    need(
        _is_int(spec.nnodes_step) and 1 <= spec.nnodes_step <= MAX_COUNT,
        f"nnodes_step must be from 1 to {MAX_COUNT}, got {spec.nnodes_step!r}",
    )
    if _is_int(spec.nnodes_step) and spec.nnodes_step >= 1:
        low = -(-spec.min_nodes // spec.nnodes_step) * spec.nnodes_step
        need(
            low <= spec.max_nodes,
            f"no node count from {spec.min_nodes} to {spec.max_nodes} is a multiple of "
            f"--nnodes-step {spec.nnodes_step}",
        )


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_text(value: Any) -> TypeGuard[str]:
    """A string that can reach an argv, an environment or a file name: valid Unicode
    (no lone surrogate) and no NUL byte."""
    if not isinstance(value, str) or "\0" in value:
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def parse_nnodes(value: str | int) -> tuple[int, int]:
    try:
        return protocol.parse_nnodes(value)
    except ValueError as exc:
        raise InvalidSpec(str(exc)) from None


def parse_nproc(value: str | int) -> int | str:
    try:
        return protocol.parse_nproc(value)
    except ValueError as exc:
        raise InvalidSpec(str(exc)) from None


def local_nproc(nproc_per_node: int | str, *, gpus: int, cpus: int) -> int:
    """How many workers ``nproc_per_node`` means on a node with ``gpus`` GPUs (free for the
    job) and ``cpus`` CPUs, as torchrun resolves it on its own host."""
    if nproc_per_node == GPU or (nproc_per_node == AUTO and gpus):
        return gpus
    if nproc_per_node in (CPU, AUTO):
        return cpus
    return int(nproc_per_node)


@dataclass(frozen=True)
class Worker:
    local_rank: int
    rank: int
    world_size: int
    node: str
    pid: int | None = None
    state: WorkerState = WorkerState.INIT
    exit_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "node": self.node,
            "pid": self.pid,
            "state": self.state.value,
            "exit_code": self.exit_code,
        }


@dataclass(frozen=True)
class WorkerGroup:
    """This node's share of one round of a job: torchelastic's WorkerGroup."""

    job_id: str
    round: int
    restart_count: int
    group_rank: int
    group_world_size: int
    rank_base: int
    world_size: int
    master_addr: str
    master_port: int
    workers: tuple[Worker, ...]
    gpus: tuple[str, ...] = ()

    @property
    def local_world_size(self) -> int:
        return len(self.workers)

    def with_worker(self, worker: Worker) -> WorkerGroup:
        workers = tuple(worker if w.local_rank == worker.local_rank else w for w in self.workers)
        return replace(self, workers=workers)


def assign_workers(
    job_id: str,
    node: str,
    *,
    round: int,
    restart_count: int,
    group_rank: int,
    group_world_size: int,
    rank_base: int,
    world_size: int,
    nproc: int,
    master_addr: str,
    master_port: int,
    gpus: tuple[str, ...] = (),
) -> WorkerGroup:
    """Global ranks of this node's workers: ``rank_base + local_rank`` (one role)."""
    workers = tuple(
        Worker(local_rank=i, rank=rank_base + i, world_size=world_size, node=node)
        for i in range(nproc)
    )
    return WorkerGroup(
        job_id,
        round,
        restart_count,
        group_rank,
        group_world_size,
        rank_base,
        world_size,
        master_addr,
        master_port,
        workers,
        gpus,
    )


def master_ports(spec: JobSpec) -> tuple[int, ...]:
    """The ports a join may offer for its round's store, in order: none (any free port), or
    ``--master-port P``.  In place also P + 1: the survivors of a round stay in its group,
    and so need its store, until they leave it at a commit, while the next round forms; a
    node first in both serves the next one at the other port."""
    if not spec.master_port:
        return ()
    return (spec.master_port, spec.master_port + 1) if spec.in_place else (spec.master_port,)


def placement_env(group: WorkerGroup, worker: Worker) -> dict[str, str]:
    """What a worker's place in a round sets: all an in-place survivor gets anew."""
    return {
        "RANK": str(worker.rank),
        "GROUP_RANK": str(group.group_rank),
        "ROLE_RANK": str(worker.rank),
        "WORLD_SIZE": str(group.world_size),
        "GROUP_WORLD_SIZE": str(group.group_world_size),
        "ROLE_WORLD_SIZE": str(group.world_size),
        "LOCAL_WORLD_SIZE": str(group.local_world_size),
        "MASTER_ADDR": group.master_addr,
        "MASTER_PORT": str(group.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(group.restart_count),
    }


TORCHRUN_HANDLED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def worker_env(
    spec: JobSpec, group: WorkerGroup, worker: Worker, *, error_file: str
) -> dict[str, str]:
    """The environment torchrun gives a worker, on top of the submitter's environment.  A
    worker warming up for an in-place job (``group.round < 0``) has no rank yet."""
    env = dict(spec.env)
    env.update(
        {
            "LOCAL_RANK": str(worker.local_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(group.local_world_size),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.id,
            # as torchrun's: the daemon of the round's first node serves its store (the
            # shell's roundstore.py), listening before any worker of the round starts
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_ERROR_FILE": error_file,
            # torchrun's 1 (TearDown) is documented to end the process when NCCL reports a dead
            # peer; an in-place survivor must live on: 2 (CleanUpOnly) aborts the communicator
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": spec.env.get(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "2" if spec.in_place else "1"
            ),
            # torchrun's launcher process sets it (its --signals-to-handle) and workers inherit it
            "TORCHELASTIC_SIGNALS_TO_HANDLE": spec.env.get(
                "TORCHELASTIC_SIGNALS_TO_HANDLE", TORCHRUN_HANDLED_SIGNALS
            ),
        }
    )
    if group.round >= 0:
        env.update(placement_env(group, worker))
    if "OMP_NUM_THREADS" not in spec.env and group.local_world_size > 1:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default: don't oversubscribe the CPUs
    if group.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(group.gpus)
    elif spec.nproc_per_node == CPU:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU workers: the node's GPUs belong to other jobs
    return env


@dataclass(frozen=True)
class Failure:
    """Why a worker failed: its exit and, if it used torch's @record, its error file."""

    rank: int
    local_rank: int
    node: str
    exit_code: int
    message: str
    traceback: str = ""
    timestamp: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Failure:
        return cls(**{k: doc[k] for k in cls.__dataclass_fields__ if k in doc})


@dataclass(frozen=True)
class RunResult:
    """How a worker group ended: SUCCEEDED when all workers did, else the failures by rank."""

    state: WorkerState
    failures: tuple[Failure, ...] = ()

    @property
    def root_cause(self) -> Failure | None:
        """The first failure in time, as torchrun reports it."""
        return min(self.failures, key=lambda f: (f.timestamp, f.rank)) if self.failures else None


@dataclass(frozen=True)
class NodeInfo:
    """What a node publishes about itself in the cluster."""

    name: str
    address: str
    slots: int
    gpus: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    version: str = ""
    draining: bool = False
    started: float = 0.0
    cpus: int = 0  # 0: not published (a daemon of an older version)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["labels"] = dict(self.labels)
        doc["gpus"] = list(self.gpus)
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> NodeInfo:
        fields = {k: doc[k] for k in cls.__dataclass_fields__ if k in doc}
        fields["gpus"] = tuple(fields.get("gpus", ()))
        return cls(**fields)
