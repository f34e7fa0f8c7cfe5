"""DaemonConfig: the daemon's settings, from TOML and command-line overrides.

Every key is declared once, in the section dataclasses below: its type, its default and a
validator.  ``packaging/elasticd.toml`` documents the same keys and a test keeps the two in
agreement.  A bad key or value raises ConfigError naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import stat
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elasticd.core import fairshare
from elasticd.core.allocation import Policy, Quota
from elasticd.core.blacklist import BlacklistPolicy
from elasticd.core.containment import MIN_MEMORY, MIN_PIDS, parse_memory
from elasticd.core.detector import DetectorSettings
from elasticd.core.gpuhealth import DRAIN_XIDS, GpuPolicy
from elasticd.core.liveness import KeepAlive
from elasticd.core.model import MAX_PRIORITY, JobSpec
from elasticd.core.quotas import PriorityBounds, SubmitLimits
from elasticd.endpoint import split_endpoint
from elasticd.errors import ConfigError
from elasticd.shell.logs import MAX_BACKUPS, MIN_MAX_BYTES, OutputLimit
from elasticd.wire import paths

AUTO = "auto"
ETCD = "etcd"
BACKENDS = ("c10d", ETCD)


def _port(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "must be a port number (0..65535)"


def _positive(value: float) -> str | None:
    return None if value > 0 else "must be greater than 0"


def _not_negative(value: float) -> str | None:
    return None if value >= 0 else "must be 0 or more"


def _off_or_at_least_a_second(value: float) -> str | None:
    return None if value == 0 or value >= 1 else "must be 0 (off) or at least 1 (seconds)"


def _endpoint(value: str) -> str | None:
    try:
        split_endpoint(value)
    except ValueError:
        return "must be HOST:PORT or [IPV6]:PORT (port 0: a free port, for the store host only)"
    return None


def _backend(value: str) -> str | None:
    return None if value in BACKENDS else f"must be one of {', '.join(BACKENDS)}"


def _members(value: list[str]) -> str | None:
    for endpoint in value:
        if _endpoint(endpoint) or split_endpoint(endpoint)[1] == 0:
            return f"must list HOST:PORT or [IPV6]:PORT addresses; {endpoint!r} is not one"
    return None


def _gpus(value: int | str) -> str | None:
    if value == AUTO or (isinstance(value, int) and value >= 0):
        return None
    return f"must be '{AUTO}' or a GPU count (0 or more)"


def _cgroup_setting(value: str) -> str | None:
    if value in (AUTO, "off") or (value.startswith("/") and ".." not in value.split("/")):
        return None
    return f"must be '{AUTO}', 'off' or an absolute cgroup path such as /elasticd"


def _max_pids(value: int) -> str | None:
    if value == 0 or value >= MIN_PIDS:
        return None
    return f"must be 0 (no limit) or at least {MIN_PIDS}"


def _max_memory(value: str) -> str | None:
    try:
        size = parse_memory(value, 1 << 40)
    except ValueError as exc:
        return str(exc)
    if size == 0 or size >= MIN_MEMORY:
        return None
    return f"must be 0 (no limit) or at least {MIN_MEMORY >> 20} MiB"


def _script(value: str) -> str | None:
    return (
        None
        if value == "" or value.startswith("/")
        else "must be empty (no discovery) or the absolute path of an executable"
    )


def _cooldown_range(value: list[float]) -> str | None:
    if len(value) == 2 and 0 < value[0] <= value[1]:
        return None
    return "must be [MIN, MAX] seconds with 0 < MIN <= MAX"


def _max_bytes(value: int) -> str | None:
    if value == 0 or value >= MIN_MAX_BYTES:
        return None
    return f"must be 0 (no limit) or at least {MIN_MAX_BYTES} bytes (64 KiB)"


def _backups(value: int) -> str | None:
    return None if 0 <= value <= MAX_BACKUPS else f"must be 0..{MAX_BACKUPS}"


def _log_level(value: str) -> str | None:
    levels = ("debug", "info", "warning", "error")
    return None if value in levels else f"must be one of {', '.join(levels)}"


def _priority(value: int) -> str | None:
    return None if 0 <= value <= MAX_PRIORITY else f"must be 0..{MAX_PRIORITY}"


QUOTA_KEYS = tuple(f.name for f in dataclasses.fields(Quota))


def _check_quota(dotted: str, table: dict[str, int]) -> None:
    """A quota table: limits on nodes, gpus and slots, each 0 or more (absent: none)."""
    for name, limit in table.items():
        if name not in QUOTA_KEYS:
            raise ConfigError(f"{dotted}.{name}", f"unknown key (known: {', '.join(QUOTA_KEYS)})")
        if limit < 0:
            raise ConfigError(f"{dotted}.{name}", f"must be 0 or more, got {limit!r}")


def key(
    default: Any, check: Callable[[Any], str | None] | None = None, doc: str = "", flag: str = ""
) -> Any:
    """Declare a config key: its default, an optional validator, a one-line doc and the
    elasticd command-line flag that sets it, if any."""
    kwargs: dict[str, Any] = {"metadata": {"check": check, "doc": doc, "flag": flag}}
    if isinstance(default, (dict, list)):
        kwargs["default_factory"] = lambda: type(default)(default)
    else:
        kwargs["default"] = default
    return field(**kwargs)


@dataclass(frozen=True)
class NodeConfig:
    """[node]: how this node is named and reached, and what it offers (slots, GPUs)."""

    name: str = key(
        "", doc="this node's name in the cluster; empty: the hostname", flag="--node-name"
    )
    address: str = key(
        "",
        doc="address peers use to reach this node (its workers' MASTER_ADDR when it holds group rank 0); empty: this host's address on the route to the store",
        flag="--node-address",
    )
    peer_port: int = key(
        29401,
        _port,
        doc="port for peers: log fetches (CURVE), and probes when a job's workers fail (a reset: its daemon died, and the job re-forms without it, spending no restart; silence counts as death only if its heartbeat stopped too); keep it open between nodes: a firewall that rejects it makes worker failures look like node loss; 0: any",
    )
    tier_port: int = key(
        0,
        _port,
        doc="port of the checkpoint tier's data plane (CURVE, as the peer port): each node streams its share of a checkpoint to another node, and fetches what a restarted round needs; it travels in the node's record; 0: any free port (set one where a firewall sits between nodes)",
    )
    tier_bulk_port: int = key(
        0,
        _port,
        doc="port of the checkpoint tier's bulk bytes: a node that opened a session on the tier port (CURVE) gets a fresh AES-256-GCM key there and sends and fetches the chunks here, sealed with it (several GB/s, where CURVE moves about 600 MiB/s on a core); nothing that does not open under a live session's key is read; 0: any free port (set one where a firewall sits between nodes)",
    )
    peer_timeout: float = key(
        15.0,
        _positive,
        doc="seconds a request to another daemon (its ranks' logs) waits for the first answer; then its logs are unavailable for now and asked for again",
    )
    slots: int = key(
        0,
        _not_negative,
        doc="workers this node runs at once (a job's --nproc-per-node N needs N free slots; raise it to run more workers than CPUs); 0: one per CPU",
        flag="--slots",
    )
    gpus: int | str = key(
        AUTO,
        _gpus,
        doc="GPU count, or 'auto': NVML's devices (by UUID, their health watched; see [gpu]), else nvidia-smi's",
        flag="--gpus",
    )
    labels: dict[str, str] = key(
        {}, doc="labels published with this node (shown by elasticctl nodes)"
    )


@dataclass(frozen=True)
class ClusterConfig:
    """[cluster]: which cluster this node belongs to, and its key (the same on every node)."""

    name: str = key("default", doc="cluster name; namespaces every store key", flag="--cluster")
    key_file: str = key(
        "",
        doc="the key that store records are signed (HMAC) and encrypted with, a 0600 file; empty: <state_dir>/cluster.key (made by the store host, or by `elasticd keygen FILE`; copy the same file to every node)",
        flag="--cluster-key",
    )


@dataclass(frozen=True)
class StoreConfig:
    """[store]: the store the daemons meet in.  A c10d TCPStore (endpoint, host, firewall) or an
    etcd v3 cluster (endpoints and the keys after them; TLS when ca_file is set).  With etcd no
    daemon hosts the store."""

    backend: str = key(
        "c10d",
        _backend,
        doc="'c10d' (a TCPStore that one daemon hosts) or 'etcd' (an etcd v3 cluster: no daemon hosts the store, so cluster.key_file must be on every node first)",
    )
    endpoint: str = key(
        "127.0.0.1:29400", _endpoint, doc="the cluster's TCPStore, HOST:PORT", flag="--store"
    )
    host: bool | str = key(
        AUTO,
        doc="host the store here; 'auto': when the endpoint's host is node.address (node.address unset: any address of this host)",
        flag="--store-host",
    )
    firewall: bool | str = key(
        AUTO,
        doc="let only this daemon's user reach the store port from this host (an nftables rule); 'auto': when root and nft is installed; true: refuse to start without it",
    )
    connect_timeout: float = key(60.0, _positive, doc="seconds to keep retrying the store at start")
    timeout: float = key(30.0, _positive, doc="seconds a single store operation may take")
    max_memory: str = key(
        "25%",
        _max_memory,
        doc="the keys and values the store this daemon hosts (c10d) may hold: bytes, a size such as 4G or 512M, or a share of this node's memory such as 25% (at least 16 MiB); a write past it closes the writer's connection, logged once a minute; 0: no limit",
    )
    endpoints: list[str] = key(
        [],
        _members,
        doc="etcd: the members' client addresses, HOST:PORT each (a call moves to the next member when its own is gone)",
    )
    ca_file: str = key("", doc="etcd: the CA of the members' certificates (PEM); set: TLS")
    cert_file: str = key(
        "", doc="etcd: this daemon's client certificate (PEM), for members that want one"
    )
    key_file: str = key("", doc="etcd: the client certificate's private key (PEM, 0600)")
    user: str = key(
        "", doc="etcd: the user to authenticate as; empty: none (or the client certificate's)"
    )
    password_file: str = key("", doc="etcd: a 0600 file holding the user's password")
    compact_interval: float = key(
        300.0,
        _off_or_at_least_a_second,
        doc="etcd: seconds between two compactions of etcd's history by the daemon that observes the cluster, each up to the revision of one interval before (etcd keeps every revision until compacted, and refuses writes past its space quota); 0: never, for an etcd compacted by its operator (--auto-compaction-retention) or whose history another program needs",
    )

    def __post_init__(self) -> None:
        if self.backend != ETCD:
            return
        if not self.endpoints:
            raise ConfigError(
                "store.endpoints", "must list the etcd members when store.backend is 'etcd'"
            )
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError(
                "store.key_file" if self.cert_file else "store.cert_file",
                "store.cert_file and store.key_file go together",
            )
        if bool(self.user) != bool(self.password_file):
            raise ConfigError(
                "store.password_file" if self.user else "store.user",
                "store.user and store.password_file go together",
            )

    def password(self) -> str:
        """The etcd user's password, read from password_file (which only its owner may
        read); "" without one."""
        if not self.password_file:
            return ""
        path, dotted = self.password_file, "store.password_file"
        try:
            with open(path, "rb") as file:
                mode = os.fstat(file.fileno()).st_mode
                text = file.read().rstrip(b"\r\n")
        except OSError as exc:
            raise ConfigError(dotted, f"cannot read {path}: {exc.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                dotted,
                f"{path} is accessible by group or others (mode {mode & 0o777:o}); chmod 600 it",
            )
        try:
            password = text.decode()
        except UnicodeDecodeError:
            raise ConfigError(dotted, f"{path} is not UTF-8 text") from None
        if not password:
            raise ConfigError(dotted, f"{path} is empty")
        return password


@dataclass(frozen=True)
class PathsConfig:
    """[paths]: where this daemon keeps its state and its socket."""

    state_dir: str = key(
        paths.SYSTEM_STATE_DIR, doc="job history, logs and the cluster key", flag="--state-dir"
    )
    runtime_dir: str = key(paths.SYSTEM_RUNTIME_DIR, doc="the control socket", flag="--runtime-dir")


@dataclass(frozen=True)
class MetricsConfig:
    """[metrics]: the Prometheus endpoint."""

    port: int = key(
        9464, _port, doc="Prometheus endpoint port; 0 disables it", flag="--metrics-port"
    )
    address: str = key("0.0.0.0", doc="address the Prometheus endpoint binds")


@dataclass(frozen=True)
class ControlConfig:
    """[control]: the control socket: who acts on every job, and how many connections."""

    admin_group: str = key(
        "elasticd-admin",
        doc="members act on every job, like root, and read every job's files on disk",
    )
    max_connections: int = key(
        1024,
        _positive,
        doc="open control-socket connections, all users together (kept within a quarter of the open-file limit); beyond it a connection is told why and closed",
    )
    max_connections_per_user: int = key(
        32,
        _positive,
        doc="open control-socket connections of one user; beyond it a connection is told why and closed",
    )


@dataclass(frozen=True)
class JobsConfig:
    """[jobs]: jobs on this node: who may run as root, how they stop, the defaults a submit
    leaves out, what one user may submit and what one job may use here.

    A real command line is a few hundred bytes and a login environment a few KiB, so 128 KiB
    each refuses no real job, and bounds what one user's submits make every daemon, the store
    and the history keep.  1024 tasks per worker is several times what a torch worker with its
    threads and DataLoader processes needs, and stops a fork bomb long before kernel.pid_max
    (keep slots x this below it).  Memory has no limit by default: a job sized for its node
    must not be killed by an upgrade."""

    allow_root: bool = key(
        False,
        doc="run jobs submitted by root as root (a --standalone daemon: true unless set)",
        flag="--allow-root",
    )
    stop_grace: float = key(10.0, _not_negative, doc="seconds between SIGTERM and SIGKILL")
    max_restarts: int = key(
        JobSpec.max_restarts, _not_negative, doc="default job-wide restart budget"
    )
    exit_barrier_timeout: float = key(
        JobSpec.exit_barrier_timeout, _positive, doc="default exit barrier timeout, seconds"
    )
    join_timeout: float = key(
        JobSpec.join_timeout, _positive, doc="default seconds a job waits for min nodes"
    )
    last_call_timeout: float = key(
        JobSpec.last_call_timeout, _not_negative, doc="extra seconds for nodes after min joined"
    )
    cgroup: str = key(
        "auto",
        _cgroup_setting,
        doc="where jobs' cgroups go: 'auto' (a delegated systemd unit's, else under our own), 'off' (process groups only), or a cgroup path such as /elasticd",
    )
    max_pids_per_worker: int = key(
        1024,
        _max_pids,
        doc="processes and threads one job may have on this node, per worker it runs here (its cgroup's pids.max; without the pids controller, each worker's RLIMIT_NPROC); 0: no limit, else at least 16",
    )
    max_memory: str = key(
        "0",
        _max_memory,
        doc="memory (RAM and swap together) one job may use on this node, in its cgroup: bytes, a size such as 64G or 512M, or a share of this node's memory such as 90% (at least 16 MiB); past it the OOM killer ends the job there and it fails; 0: no limit",
    )
    max_argv_bytes: int = key(
        SubmitLimits.argv_bytes,
        _positive,
        doc="bytes of a job's command line (its arguments, as execve counts them); a larger submit is refused (Linux refuses one string over 128 KiB, and all of them together over about 2 MiB)",
    )
    max_env_bytes: int = key(
        SubmitLimits.env_bytes,
        _positive,
        doc="bytes of a job's environment (the submitter's, with --env, as execve counts it); a larger submit is refused",
    )
    max_per_user: int = key(
        SubmitLimits.per_user,
        _not_negative,
        doc="jobs of one user that have not ended (pending or running, in the whole cluster as this node sees it); root and the admin group are exempt; 0: no limit",
    )

    @property
    def limits(self) -> SubmitLimits:
        return SubmitLimits(self.max_argv_bytes, self.max_env_bytes, self.max_per_user)


@dataclass(frozen=True)
class CheckpointsConfig:
    """[checkpoints]: the checkpoint tier: each job's ELASTICD_CHECKPOINT_DIR, kept in this
    node's memory (a tmpfs of its own when the daemon runs as root, its size the job's cap;
    its pages count in the job's memory limit), its shares copied to another node.  The
    caps bound what checkpoints may take of this node's memory, so that it never swaps or
    runs out for them: a save over a job's cap fails in the job (no space left on device)
    and the checkpoint before it stays in force."""

    max_memory: str = key(
        "50%",
        _max_memory,
        doc="memory all jobs' checkpoint directories may hold together on this node: bytes, a size such as 64G, or a share of this node's memory such as 50%; 0: no cap",
    )
    job_memory: str = key(
        "0",
        _max_memory,
        doc="a job's checkpoint directory here when its submit says no --checkpoint-memory (and never more than max_memory leaves beside the other jobs'); 0: what max_memory leaves",
    )


@dataclass(frozen=True)
class RendezvousConfig:
    """[rendezvous]: heartbeats; a node is lost after keep_alive_max_attempt still ones."""

    keep_alive_interval: float = key(KeepAlive.interval, _positive, doc="heartbeat period, seconds")
    keep_alive_max_attempt: int = key(
        KeepAlive.attempts, _positive, doc="missed heartbeats before a node is lost"
    )

    @property
    def keep_alive(self) -> KeepAlive:
        return KeepAlive(self.keep_alive_interval, self.keep_alive_max_attempt)


@dataclass(frozen=True)
class DetectorConfig:
    """[detector]: the failure detector (SWIM with Lifeguard's local health): the members of
    a job's round probe each other over UDP at the peer port's number, so that a node that
    freezes, loses power or is cut off is lost to the survivors in about lost_after seconds
    instead of keep_alive_interval x keep_alive_max_attempt.  The store's heartbeat stays the
    slow, authoritative path.  Shorter times find a loss sooner and take a slow node (a pause,
    a starved process) for a lost one sooner: see docs/operations.md."""

    enabled: bool = key(
        True,
        doc="probe the members of this node's rounds directly (UDP, node.peer_port's number; keep it open between nodes); false: heartbeats only",
    )
    interval: float = key(
        DetectorSettings.interval, _positive, doc="seconds between two probes of a neighbour"
    )
    suspect_after: float = key(
        DetectorSettings.suspect_after,
        _positive,
        doc="seconds of silence after which other nodes are asked to probe a neighbour too",
    )
    lost_after: float = key(
        DetectorSettings.lost_after,
        _positive,
        doc="seconds of silence after which a neighbour is lost, once another node confirmed that it cannot reach it either (longer while this node itself is slow: local health)",
    )
    helpers: int = key(
        DetectorSettings.helpers, _positive, doc="nodes asked to probe a silent neighbour"
    )
    max_rate: float = key(
        2000.0,
        _positive,
        doc="datagrams a second the detector reads at most (a flood beyond it is left to the kernel to drop, and its time is not counted as anyone's silence)",
    )

    def __post_init__(self) -> None:
        if self.suspect_after >= self.lost_after:
            raise ConfigError("detector.suspect_after", "must be less than detector.lost_after")

    @property
    def settings(self) -> DetectorSettings:
        return DetectorSettings(
            interval=self.interval,
            suspect_after=self.suspect_after,
            lost_after=self.lost_after,
            helpers=self.helpers,
        )


@dataclass(frozen=True)
class DiscoveryConfig:
    """[discovery]: host discovery (Horovod's --host-discovery-script).  Every daemon runs the
    script itself and applies the list to itself only; a node that is not listed is drained.
    The daemon runs it as root, so it must be root's alone."""

    script: str = key(
        "",
        _script,
        doc="an executable that prints the nodes that may take work, one host[:slots] a line (a node not listed is drained); empty: no discovery",
    )
    interval: float = key(1.0, _positive, doc="seconds between runs of the discovery script")
    timeout: float = key(10.0, _positive, doc="seconds one run of the discovery script may take")


@dataclass(frozen=True)
class BlacklistConfig:
    """[blacklist]: failures count against the user whose job failed, not the node; the node is
    blacklisted only when a second user's jobs are kept off it too."""

    failures: int = key(
        BlacklistPolicy.failures,
        _not_negative,
        doc="failures of one user's workers on this node within the window that keep that user's jobs off it (two such users: the node is blacklisted); 0: no blacklist",
    )
    window: float = key(
        BlacklistPolicy.window, _positive, doc="seconds within which those failures count"
    )
    cooldown_range: list[float] = key(
        [BlacklistPolicy.cooldown_min, BlacklistPolicy.cooldown_max],
        _cooldown_range,
        doc="[min, max] seconds a cooldown lasts (a user's jobs kept off, or a blacklisted node): min, doubled each time in a row, with jitter",
    )

    @property
    def policy(self) -> BlacklistPolicy:
        return BlacklistPolicy(self.failures, self.window, *self.cooldown_range)


def _xids(value: list[int]) -> str | None:
    return None if all(x > 0 for x in value) else "must be a list of Xid numbers"


@dataclass(frozen=True)
class GpuConfig:
    """[gpu]: GPU health from NVML (node.gpus = "auto" and libnvidia-ml.so.1 here): a GPU that
    NVML reads bad is taken out of this node's offer, and its jobs re-form without it."""

    health_interval: float = key(
        10.0,
        _not_negative,
        doc="seconds between NVML health checks of this node's GPUs (node.gpus = 'auto' and NVML present); 0: none",
    )
    readmit_after: float = key(
        0.0,
        _not_negative,
        doc="seconds a GPU taken out must read healthy before it is offered again; 0: only `elasticctl undrain NODE --gpu N` readmits it",
    )
    drain_xids: list[int] = key(
        sorted(DRAIN_XIDS),
        _xids,
        doc="Xid events that take a GPU out of the offer (hardware: 79 fallen off the bus, 48/94/95 ECC, 63/64 row remap, 74 NVLink ...); other Xids are logged and counted",
    )

    @property
    def policy(self) -> GpuPolicy:
        return GpuPolicy(frozenset(self.drain_xids), self.readmit_after)


@dataclass(frozen=True)
class OutputConfig:
    """[output]: workers' output files, rotated as logrotate does it: each stream of a round
    holds at most (backups + 1) x max_bytes on disk."""

    max_bytes: int = key(
        100 * 1024 * 1024,
        _max_bytes,
        doc="bytes at which a worker's stdout or stderr file (rank_<r>.out|.err) is rotated; 0: never (no limit), else at least 65536 (64 KiB)",
    )
    backups: int = key(
        3,
        _backups,
        doc="rotated files kept of each, 0..100 (rank_<r>.out.1 the newest); the oldest is deleted",
    )

    @property
    def limit(self) -> OutputLimit:
        return OutputLimit(self.max_bytes, self.backups)


@dataclass(frozen=True)
class HistoryConfig:
    """[history]: retention, checked at start and whenever a job is due; a job without an
    outcome, or whose workers on this node are still being stopped, is never deleted."""

    retention: float = key(
        30 * 24 * 3600.0,
        _not_negative,
        doc="seconds after its end that a job's history row and output are deleted (2592000: 30 days), and its records in the store (by the daemon that observes the cluster); 0: kept forever",
    )


@dataclass(frozen=True)
class LogConfig:
    """[log]: the daemon's own log."""

    level: str = key("info", _log_level, doc="debug, info, warning or error", flag="--log-level")
    summary_interval: float = key(
        60.0,
        _positive,
        doc="seconds between the lines of a warning that repeats (a refused peer connection or store record, a loop's unexpected error): the first is logged, the rest counted and summed up once per interval",
    )


@dataclass(frozen=True)
class SchedulerConfig:
    """[scheduler]: the cluster's scheduler (the same on every node; the allocator's applies).
    Jobs start in order of --priority, then fair share, then age; quotas bound what users and
    accounts hold at once."""

    enabled: bool = key(
        True,
        doc="the cluster follows the allocation its elected daemon publishes (priority, fair share, quotas; shrink to admit, grow to fill); false: each node offers itself to the oldest open job it fits",
    )
    resize_interval: float = key(
        30.0,
        _not_negative,
        doc="seconds between two growths of one job (reclaiming nodes for a waiting job, and failures, are not delayed)",
    )
    min_run_time: float = key(
        60.0,
        _not_negative,
        doc="seconds a job runs after its start, a resize or a preemption before the scheduler may take a node from it again (reclaim it for a waiting job, or preempt it); each node a job takes from a running one is charged to its account as this many node-seconds of use, for fair share; 0: no minimum, no charge",
    )
    half_life: float = key(
        fairshare.HALF_LIFE,
        _not_negative,
        doc="seconds in which an account's recorded use halves, for fair share (604800: 7 days, as Slurm's PriorityDecayHalfLife); 0: none is kept",
    )
    max_priority: int = key(
        0,
        _priority,
        doc="the highest --priority a user may ask (0 or less is always allowed; a user's bound is the highest of this, priority_users and priority_groups that applies); root and control.admin_group may ask any",
    )
    priority_users: dict[str, int] = key(
        {},
        doc="user -> the highest --priority that user may ask, where above max_priority, e.g. {alice = 10}",
    )
    priority_groups: dict[str, int] = key(
        {}, doc="group -> the highest --priority its members may ask, where above max_priority"
    )
    user_quota: dict[str, int] = key(
        {},
        doc="each user's limits on what their jobs hold at once: nodes, gpus, slots (a limit not set: none), e.g. {nodes = 4, gpus = 8}; a job over one waits (QuotaUser)",
    )
    account_quota: dict[str, int] = key(
        {},
        doc="each account's limits, as user_quota (an account: a group, --account; by default the user's primary group); a job over one waits (QuotaAccount)",
    )
    users: dict[str, dict[str, int]] = key(
        {},
        doc="user -> that user's own limits, each in place of user_quota's (those it does not set stay), e.g. {alice = {nodes = 8}}, or as a table [scheduler.users.alice]",
    )
    accounts: dict[str, dict[str, int]] = key(
        {},
        doc="account -> that account's own limits, each in place of account_quota's (those it does not set stay)",
    )
    shares: dict[str, float] = key(
        {},
        doc="account -> its share of the cluster for fair share (greater than 0; an account not listed: 1.0), e.g. {ml = 2.0}",
    )

    def __post_init__(self) -> None:
        for name in ("priority_users", "priority_groups"):
            for who, bound in getattr(self, name).items():
                if problem := _priority(bound):
                    raise ConfigError(f"scheduler.{name}.{who}", f"{problem}, got {bound!r}")
        for name in ("user_quota", "account_quota"):
            _check_quota(f"scheduler.{name}", getattr(self, name))
        for name in ("users", "accounts"):
            for who, table in getattr(self, name).items():
                _check_quota(f"scheduler.{name}.{who}", table)
        for account, share in self.shares.items():
            if not 0 < share < math.inf:
                raise ConfigError(
                    f"scheduler.shares.{account}", f"must be greater than 0, got {share!r}"
                )

    def policy(self) -> Policy:
        """The allocator's policy.  A user's or an account's own entry replaces the limits
        it sets of the default and keeps the others."""
        user_default, account_default = Quota(**self.user_quota), Quota(**self.account_quota)
        return Policy(
            users={user: dataclasses.replace(user_default, **q) for user, q in self.users.items()},
            accounts={
                name: dataclasses.replace(account_default, **q) for name, q in self.accounts.items()
            },
            user_default=user_default,
            account_default=account_default,
            account_shares=dict(self.shares),
            resize_interval=self.resize_interval,
            half_life=self.half_life,
            min_run_time=self.min_run_time,
        )

    @property
    def priority_bounds(self) -> PriorityBounds:
        return PriorityBounds(
            self.max_priority, dict(self.priority_users), dict(self.priority_groups)
        )

    def priority_bound(self, user: str, groups: typing.Iterable[str], is_admin: bool) -> int | None:
        """The highest --priority ``user`` (in ``groups``) may ask; None: any (root, admins)."""
        return self.priority_bounds.of(user, groups, is_admin)


@dataclass(frozen=True)
class DaemonConfig:
    node: NodeConfig = field(default_factory=NodeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    jobs: JobsConfig = field(default_factory=JobsConfig)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    blacklist: BlacklistConfig = field(default_factory=BlacklistConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    history: HistoryConfig = field(default_factory=HistoryConfig)
    log: LogConfig = field(default_factory=LogConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    checkpoints: CheckpointsConfig = field(default_factory=CheckpointsConfig)
    standalone: bool = False

    @property
    def node_name(self) -> str:
        return self.node.name or socket.gethostname()

    @property
    def key_file(self) -> str:
        return self.cluster.key_file or os.path.join(self.paths.state_dir, "cluster.key")

    @property
    def log_dir(self) -> str:
        """Where workers' output goes: <log_dir>/<job>/attempt_<n>/rank_<r>.{out,err}."""
        return os.path.join(self.paths.state_dir, "logs")

    @property
    def socket_path(self) -> str:
        return os.path.join(self.paths.runtime_dir, paths.SOCKET_NAME)

    @property
    def store_host(self) -> str:
        """The store's host (with etcd: the first member's)."""
        return split_endpoint(self.store.endpoints[0] if self.etcd else self.store.endpoint)[0]

    @property
    def etcd(self) -> bool:
        return self.store.backend == ETCD and not self.standalone

    @property
    def store_port(self) -> int:
        return split_endpoint(self.store.endpoint)[1]


SECTIONS: dict[str, type] = {
    name: hint for name, hint in typing.get_type_hints(DaemonConfig).items() if name != "standalone"
}


def load(
    path: str | None = None, overrides: dict[str, Any] | None = None, *, standalone: bool = False
) -> DaemonConfig:
    """Read ``path`` (TOML), apply ``overrides`` (dotted keys, e.g. ``"node.slots"``), validate."""
    return from_tables(_tables(path, overrides, standalone), standalone=standalone)


def problems(
    path: str | None = None, overrides: dict[str, Any] | None = None, *, standalone: bool = False
) -> list[ConfigError]:
    """Every error ``load`` would raise, in its order (``elasticd --check-config``): after
    each one the key it names (else its section) is set aside and the rest checked again."""
    try:
        tables = _tables(path, overrides, standalone)
    except ConfigError as exc:
        return [exc]
    found: list[ConfigError] = []
    while True:
        try:
            from_tables(tables, standalone=standalone)
            return found
        except ConfigError as exc:
            found.append(exc)
            if not _set_aside(tables, exc.key):
                return found


def _tables(path: str | None, overrides: dict[str, Any] | None, standalone: bool) -> dict[str, Any]:
    tables: dict[str, Any] = {}
    if path is not None:
        tables = _read_toml(path)
    if standalone:
        for dotted, value in standalone_defaults().items():
            _put(tables, dotted, value, replace=False)
    for dotted, value in (overrides or {}).items():
        _put(tables, dotted, value, replace=True)
    return tables


def _set_aside(tables: dict[str, Any], dotted: str) -> bool:
    """Remove the key ``dotted`` from ``tables`` (``scheduler.users.alice.nodes``: the
    innermost table's key), else its whole section; False if neither is there."""
    section, _, rest = dotted.partition(".")
    table = tables.get(section)
    while isinstance(table, dict) and rest:
        if rest in table:
            del table[rest]
            return True
        head, _, rest = rest.partition(".")
        table = table.get(head)
    return tables.pop(section, None) is not None


def from_tables(tables: dict[str, Any], *, standalone: bool = False) -> DaemonConfig:
    sections = {}
    for name, value in tables.items():
        if name not in SECTIONS:
            raise ConfigError(name, f"unknown section (known: {', '.join(SECTIONS)})")
        if not isinstance(value, dict):
            raise ConfigError(name, "must be a table")
        sections[name] = _section(name, SECTIONS[name], value)
    return DaemonConfig(**sections, standalone=standalone)


def _section(section: str, cls: type, table: dict[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in table.items():
        dotted = f"{section}.{name}"
        if name not in fields:
            raise ConfigError(dotted, f"unknown key (known: {', '.join(fields)})")
        value = _coerce(dotted, hints[name], value)
        check = fields[name].metadata["check"]
        problem = check(value) if check else None
        if problem:
            raise ConfigError(dotted, f"{problem}, got {value!r}")
        values[name] = value
    return cls(**values)


def _coerce(dotted: str, hint: Any, value: Any) -> Any:
    """Type-check one value against its annotation; ints are accepted where floats are."""
    if hint is float and _is(value, int):
        return float(value)
    if typing.get_origin(hint) is list:
        kind = typing.get_args(hint)[0]
        if not (
            isinstance(value, list)
            and all(_is(v, kind) or (kind is float and _is(v, int)) for v in value)
        ):
            raise ConfigError(dotted, f"must be {_TYPE_WORDS[hint]}, got {value!r}")
        return [kind(v) for v in value]
    if (
        typing.get_origin(hint) is dict and hint != dict[str, str]
    ):  # a table of values, each checked
        if not isinstance(value, dict):
            raise ConfigError(dotted, f"must be {_TYPE_WORDS[hint]}, got {value!r}")
        return {
            name: _coerce(f"{dotted}.{name}", typing.get_args(hint)[1], item)
            for name, item in value.items()
        }
    if hint == dict[str, str]:
        ok = isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        )
    elif hint in (int | str, bool | str):  # a value, or "auto"
        ok = value == AUTO or _is(value, int if hint == int | str else bool)
    else:
        ok = _is(value, hint)
    if not ok:
        raise ConfigError(dotted, f"must be {_TYPE_WORDS[hint]}, got {value!r}")
    return value


def _is(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


_TYPE_WORDS: dict[Any, str] = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    dict[str, str]: "a table of strings",
    int | str: f"an integer or '{AUTO}'",
    bool | str: f"true, false or '{AUTO}'",
    list[float]: "a list of numbers",
    list[str]: "a list of strings",
    list[int]: "a list of integers",
    dict[str, int]: "a table of integers",
    dict[str, float]: "a table of numbers",
    dict[str, dict[str, int]]: "a table of tables of integers",
}


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", f"{path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # tomllib decodes before it parses
        raise ConfigError(
            "--config",
            f"{path} is not valid TOML: not UTF-8 text ({exc.reason} at byte {exc.start})",
        ) from None


def _put(tables: dict[str, Any], dotted: str, value: Any, *, replace: bool) -> None:
    section, _, name = dotted.partition(".")
    table = tables.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(section, "must be a table")
    if replace or name not in table:
        table[name] = value


def standalone_defaults(uid: int | None = None) -> dict[str, Any]:
    """A one-host cluster that needs no config: its store in its own memory (app.py; the
    store keys below only say that this node is the store's host),
    per-user state and runtime dirs when not root, jobs of the daemon's user allowed."""
    return {
        "cluster.name": "standalone",
        "store.endpoint": "127.0.0.1:0",
        "store.host": True,
        "node.address": "127.0.0.1",
        "node.peer_port": 0,
        "paths.state_dir": paths.default_state_dir(uid),
        "paths.runtime_dir": paths.default_runtime_dir(uid),
        "jobs.allow_root": True,
    }


def flags() -> dict[str, tuple[str, type, str]]:
    """elasticd's command-line flags: flag -> (dotted key, value type, doc line)."""
    found = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata["flag"]:
                kind = {int | str: int, bool | str: bool}.get(hints[f.name], hints[f.name])
                found[f.metadata["flag"]] = (f"{section}.{f.name}", kind, f.metadata["doc"])
    return found


def documented_keys() -> dict[str, tuple[Any, str]]:
    """Every dotted key with its default and doc line (for the default-config agreement test)."""
    out = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            )
            out[f"{section}.{f.name}"] = (default, f.metadata["doc"])
    return out
