"""The composition root: parse argv, build every part, run them in one TaskGroup (or, for
``elasticd keygen FILE``, write a new cluster key and exit; for ``elasticd --check-config
FILE``, check a config file and exit).

Order of start-up: config -> dirs and cluster key -> store (hosted here or reached) ->
history (jobs of a previous run that died are recorded as failed, their leftovers killed)
-> control socket -> READY=1.  SIGTERM/SIGINT: STOPPING=1, stop every job's workers,
exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import functools
import logging
import math
import os
import resource
import signal
import stat
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import sdnotify
import zmq
import zmq.asyncio

from elasticd import __version__, cleanup, keygen
from elasticd import config as config_mod
from elasticd.aio import race
from elasticd.cluster.compaction import Compactor, StoreHistory
from elasticd.cluster.detector import DetectorService, next_boot, udp_endpoint
from elasticd.cluster.hosting import host_store, hosts_store, route_address, store_firewall
from elasticd.cluster.hosts import DiscoveryFailed, HostDiscovery, UntrustedScript
from elasticd.cluster.inventory import LocalNode, cpu_count, local_gpus, slot_count, watch_gpus
from elasticd.cluster.nvml import Nvml
from elasticd.cluster.peers import (
    PEER_DOMAIN,
    PeerCaller,
    PeerClient,
    PeerLinks,
    curve_policy,
    load_or_create_keys,
)
from elasticd.cluster.registry import NodeRegistry
from elasticd.cluster.scheduler import build_scheduler
from elasticd.cluster.service import NodeDuties, NodeService, Watcher
from elasticd.cluster.tierlink import TIER_DOMAIN, TierLinks, TierServer
from elasticd.config import DaemonConfig
from elasticd.control.commands import Commands, PeerCommands
from elasticd.control.server import ConnectionLimits, ControlServer, RouterServer, Zap
from elasticd.core import events
from elasticd.core.blacklist import Blacklist
from elasticd.core.containment import parse_memory
from elasticd.core.discovery import EVERYONE, Listing
from elasticd.core.gpuhealth import GpuWatch
from elasticd.core.model import JobState, NodeState
from elasticd.core.node import NodeCore, NodeSettings
from elasticd.core.placement import Resources
from elasticd.core.records import JobRecord, worker_groups
from elasticd.endpoint import join_endpoint
from elasticd.errors import ConfigError, ElasticdError, StoreConnectionError
from elasticd.faults import Faults, Throttle, held_back
from elasticd.jobs.board import BoardFollower, JobBoard
from elasticd.jobs.history import History
from elasticd.jobs.history import path_in as history_path
from elasticd.jobs.registry import JobRegistry
from elasticd.jobs.retention import BoardSweeper, Pruner
from elasticd.journal import log_handler
from elasticd.metrics import InstrumentedStore, Metrics
from elasticd.private import Private
from elasticd.shell import worker_library
from elasticd.shell.bounds import contain, memory_total
from elasticd.shell.cgroup_placement import instance_name
from elasticd.shell.cgroups import JobCgroups
from elasticd.shell.checkpoints import (
    CheckpointTier,
    TierSettings,
    remove_leftovers,
    tier_root,
)
from elasticd.shell.effectors import Effectors, MasterPorts
from elasticd.shell.fileaccess import FileAccess, restrict_earlier
from elasticd.shell.logs import LogBus
from elasticd.shell.node import NodeShell
from elasticd.shell.workers import reap_leftovers
from elasticd.store.base import Store
from elasticd.store.keyspace import Keyspace
from elasticd.store.memory import AsyncMemoryStore, MemoryStore
from elasticd.store.signing import Signer, load_key, load_or_create_key, subkey
from elasticd.store.tcpserver import TCPStoreServer
from elasticd.store.tcpstore import TCPStoreClient
from elasticd.wire import numbers
from elasticd.wire.numbers import is_whole
from elasticd.wire.paths import how_to_reach, is_own_dir

if TYPE_CHECKING:
    from elasticd.store.etcd import EtcdStore

log = logging.getLogger("elasticd")

DEFAULT_CONFIG = "/etc/elasticd/elasticd.toml"
KEYGEN = keygen.COMMAND
COMMANDS = f"""commands:
  elasticd {KEYGEN} FILE   write a new cluster key to FILE, to copy to every node
                         (elasticd {KEYGEN} --help)"""


def _strictly(parse: Callable[..., Any]) -> Callable[[str], Any]:
    """A flag's value read by wire.numbers (digits 0-9 only: no ``1_0``), for argparse."""

    def read(text: str) -> Any:
        try:
            return parse(text, signed=True)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return read


_STRICT = {int: _strictly(numbers.whole), float: _strictly(numbers.decimal)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="elasticd",
        description="Run elastic PyTorch jobs on this host.",
        usage=f"%(prog)s [options]\n       %(prog)s --check-config FILE [options]"
        f"\n       %(prog)s --clean-up [options]"
        f"\n       %(prog)s {KEYGEN} FILE",
        epilog=COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML config file (default: {DEFAULT_CONFIG} if it exists)",
    )
    p.add_argument(
        "--check-config",
        metavar="FILE",
        help="check FILE (with the options given) as start-up would and print every "
        "error; start nothing; exit 0 if it is good, 2 if not",
    )
    p.add_argument(
        "--clean-up",
        action="store_true",
        help="remove what a daemon with these options left when it died (its workers, "
        "job cgroups, store firewall table); refused while one runs. systemd "
        "runs it after every stop",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="a one-host cluster that needs no config (hosts its own store)",
    )
    for flag, (dotted, kind, doc) in config_mod.flags().items():  # declared with their keys
        if kind is bool:
            p.add_argument(flag, dest=dotted, action=argparse.BooleanOptionalAction, help=doc)
        else:
            p.add_argument(
                flag,
                dest=dotted,
                type=_STRICT.get(kind, kind),
                metavar=flag.rsplit("-", 1)[-1].upper(),
                help=doc,
            )
    p.add_argument(
        "--private",
        metavar="DIR",
        help="run the one job of elasticrun's directory DIR, on a cluster of this job's own "
        "daemons (elasticrun starts it: docs/elasticrun.md)",
    )
    p.add_argument(
        "--private-fd",
        type=int,
        metavar="FD",
        help="with --private: elasticrun's end of the channel; its close stops the daemon",
    )
    p.add_argument("--version", action="version", version=f"elasticd {__version__}")
    args = p.parse_args(argv)
    if (args.private is None) != (args.private_fd is None):
        p.error("--private DIR and --private-fd FD go together")
    if args.check_config is not None and args.config is not None:
        p.error("--check-config FILE checks FILE: leave out --config")
    return args


def load_config(args: argparse.Namespace) -> DaemonConfig:
    path = args.config
    if path is None and not args.standalone and os.path.exists(DEFAULT_CONFIG):
        path = DEFAULT_CONFIG
    return config_mod.load(path, flag_overrides(args), standalone=args.standalone)


def flag_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The config keys set on the command line (dotted key -> value)."""
    return {
        dotted: getattr(args, dotted)
        for dotted, _, _ in config_mod.flags().values()
        if getattr(args, dotted) is not None
    }


def check_config(args: argparse.Namespace) -> int:
    """``elasticd --check-config FILE``: the file and the options given, validated as start-up
    does (the same messages); 0 if good, 2 if not.  Opens nothing that the file names."""
    problems = config_mod.problems(
        args.check_config, flag_overrides(args), standalone=args.standalone
    )
    for problem in problems:
        print(f"elasticd: {problem}", file=sys.stderr)
    if problems:
        count = len(problems)
        print(f"{args.check_config}: {count} error{'s' if count != 1 else ''}", file=sys.stderr)
        return 2
    print(f"{args.check_config}: OK")
    return 0


def clean_up(args: argparse.Namespace) -> int:
    """``elasticd --clean-up``: 0 when done, 1 when a daemon runs, 2 for a bad config."""
    try:
        config = load_config(args)
    except ConfigError as exc:
        print(f"elasticd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="elasticd --clean-up: %(message)s")
    try:
        done = cleanup.clean_up(config)
    except cleanup.DaemonRunning as exc:
        print(f"elasticd --clean-up: {exc}", file=sys.stderr)
        return 1
    print(f"elasticd --clean-up: {done.summary(config.node_name)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [KEYGEN]:
        return keygen.main(argv[1:])
    args = parse_args(argv)
    if args.check_config is not None:
        return check_config(args)
    if args.clean_up:
        return clean_up(args)
    try:
        config = load_config(args)
    except ConfigError as exc:
        print(f"elasticd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log.level.upper(), handlers=[log_handler(config.node_name)])
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # TCPStore wait timeouts are routine
    # TCPStore looks up every peer's name; a lost DNS query must not stall the store for the
    # resolver's default 5 s x 2 (longer than a node's heartbeat timeout).
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    # gRPC (etcd's client) would run fork handlers at every worker spawn: ours fork to exec
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: every thread's stack
    private = Private(args.private, args.private_fd) if args.private else None
    daemon = Daemon(config, private)
    try:
        code = asyncio.run(
            daemon.run() if private is None else private.supervise(daemon.run, daemon.serving)
        )
    except ElasticdError as exc:
        log.error("%s", exc)
        if private is not None:
            private.say({"error": str(exc)})
        code = 1
    if private is not None:
        private.remove_directory()
    # Everything the daemon opened is closed: exit without the interpreter's teardown, which
    # every stop and restart would wait for (0.5 s when a store host loaded torch).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Notifier:
    """sd_notify: READY, STATUS, WATCHDOG, STOPPING.  Silent when not under systemd."""

    def __init__(self) -> None:
        self._notifier = sdnotify.SystemdNotifier() if os.environ.get("NOTIFY_SOCKET") else None
        if self._notifier is not None and self._notifier.socket is not None:
            # a reader that falls behind must never stall the event loop: drop instead
            self._notifier.socket.setblocking(False)
        self._status = ""

    def send(self, message: str) -> None:
        if self._notifier is not None:
            self._notifier.notify(message)

    def status(self, line: str) -> None:
        if line != self._status:
            self._status = line
            self.send(f"STATUS={line}")

    @staticmethod
    def watchdog_interval() -> float | None:
        """Half of WATCHDOG_USEC when the watchdog is meant for us."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if usec is None or not is_whole(usec):
            return None
        if pid and (not is_whole(pid) or int(pid) != os.getpid()):
            return None
        return int(usec) / 2e6


RECOUNT_GAP = 0.5  # seconds: the job gauges and STATUS= are recounted at most this often


def status_line(records: list[JobRecord], node: str) -> str:
    running = [r for r in records if r.state in (JobState.RUNNING, JobState.RESTARTING)]
    workers = sum(
        len(r.parts[node].workers)
        for r in running
        if node in r.parts and r.parts[node].state.active
    )
    pending = sum(1 for r in records if r.state in (JobState.PENDING, JobState.RENDEZVOUS))
    jobs = f"{len(running)} job{'s' if len(running) != 1 else ''} running"
    return f"{jobs}, {workers} worker{'s' if workers != 1 else ''}" + (
        f", {pending} waiting" if pending else ""
    )


class Daemon:
    def __init__(self, config: DaemonConfig, private: Private | None = None) -> None:
        self.config = config
        self.private = private  # a private daemon's job (elasticrun's), or None
        self.node = config.node_name
        self.notify = Notifier()
        self.metrics = Metrics(config.paths.state_dir)
        self.faults = Faults(on_fault=self.metrics.loop_fault, interval=config.log.summary_interval)
        # a refused key is logged once per log.summary_interval, counted every time
        self._refusals = Throttle(config.log.summary_interval)
        self.stop = asyncio.Event()
        self._server: TCPStoreServer | None = None
        self._history: StoreHistory | None = None  # an etcd store's, compacted by the observer
        self._store_ok = True
        self._started = time.time()
        self._recount: asyncio.TimerHandle | None = None  # the job gauges' next recount
        self._recounted = -math.inf  # when they were last recounted (the loop's clock)
        self._serving = False  # past start-up: a stop is what ends it now

    def serving(self) -> bool:
        return self._serving

    async def run(self) -> int:
        """Build every part in dependency order, run them as one task group until SIGTERM,
        then close them in reverse."""
        config = self.config
        self._local = LocalNode(self.node, self._address, config.node.labels, started=self._started)
        self._make_dirs()
        self._restrict_earlier_logs()
        discovery = self._host_discovery()
        listing = await self._discover_first(discovery)
        cluster_key = self._cluster_key()
        signer = Signer(cluster_key, config.cluster.name)
        async with contextlib.AsyncExitStack() as closing:
            store = await self._open_store(closing)
            self.metrics.store_up.set(1)
            await store.set(
                Keyspace(config.cluster.name).ping, b"1"
            )  # not an add: junk there must not stop a start
            if self.private is not None:  # its job's id, before this node takes part in anything
                closing.push_async_callback(  # withdrawn if this node stops before its submit
                    self.private.withdraw, store, signer, Keyspace(config.cluster.name).root
                )
                await self.private.claim(
                    store, signer, Keyspace(config.cluster.name).root, config, self.node
                )
            history = History(history_path(config.paths.state_dir))
            closing.callback(history.close)
            if history.quarantined:
                self.metrics.history_quarantined.inc()
            registry = JobRegistry(
                history,
                on_unsaved=lambda why: self.metrics.state_write_failed("history", why),
                retention=config.history.retention,
            )
            closing.callback(registry.close)
            unfinished = self._restore(registry, history)
            gpus, nvml = self._gpus()
            if nvml is not None:
                closing.callback(nvml.close)
            slots = slot_count(config, gpus)
            cgroups = self._cgroups()
            closing.callback(
                cgroups.close
            )  # only what is empty (a twin refused at bind takes nothing)
            self._local.containment = containment = contain(
                cgroups,
                max_memory=config.jobs.max_memory,
                max_pids_per_worker=config.jobs.max_pids_per_worker,
                slots=slots,
            )
            logs = LogBus()
            master_ports = MasterPorts()  # held a while after each pick: let go at the end
            closing.callback(master_ports.close)
            ctx = zmq.asyncio.Context()
            # every task has ended by then: destroy closes any socket one left open, which
            # term would wait for without end (the stop then hangs until systemd's SIGKILL)
            closing.callback(ctx.destroy, 0)
            zap = Zap(
                ctx,
                on_refused=lambda domain: self.metrics.peer_refused.inc(),
                interval=config.log.summary_interval,
            )
            closing.callback(zap.close)
            keys = load_or_create_keys(os.path.join(config.paths.state_dir, "peer.key"))
            nodes = NodeService(
                await self._node_registry(store, signer),
                interval=config.rendezvous.keep_alive_interval,
                faults=self.faults,
            )
            peers = PeerLinks(PeerClient(ctx, keys, timeout=config.node.peer_timeout), nodes)
            tier = self._checkpoint_tier(
                TierLinks(ctx, keys.public, keys.secret, nodes),
                lambda event: node_shell.post(event),
            )
            board = JobBoard(store, signer, config.cluster.name, on_refused=self._refused)
            detector = self._detector(
                cluster_key, lambda node: node_shell.post(events.NodesLost((node,)))
            )
            core = NodeCore(
                NodeSettings(
                    self.node,
                    Resources(slots, gpus, cpus=cpu_count()),
                    dead_after=config.rendezvous.keep_alive.dead_after,
                    standalone=config.standalone,
                    allow_root=config.jobs.allow_root,
                    judge_users=os.getuid() == 0,
                    scheduled=config.scheduler.enabled,
                ),
                blacklist=Blacklist(config.blacklist.policy)
                if config.blacklist.policy.enabled
                else None,
                gpu_watch=GpuWatch(config.gpu.policy, told=Throttle(config.log.summary_interval))
                if nvml is not None
                else None,
            )
            node_shell = NodeShell(
                core,
                board=board,
                registry=registry,
                metrics=self.metrics,
                faults=self.faults,
                standalone=config.standalone,
                follower=BoardFollower(
                    board, registry, self.node, on_store=self._board_store, faults=self.faults
                ),
                effectors=Effectors(
                    node=self.node,
                    address=self._address,
                    store=store,
                    signer=signer,
                    keyspace=Keyspace(config.cluster.name),
                    keep_alive=config.rendezvous.keep_alive,
                    log_root=config.log_dir,
                    metrics=self.metrics,
                    logs=logs,
                    probe=peers,
                    refused=self._refused,
                    stop_grace=config.jobs.stop_grace,
                    cgroups=cgroups if cgroups.available else None,
                    containment=containment,
                    master_ports=master_ports,
                    runtime_dir=config.paths.runtime_dir,
                    output_limit=config.output.limit,
                    access=FileAccess(config.control.admin_group),
                    faults=self.faults,
                    worker_library=worker_library.install(config.paths.runtime_dir),
                    tier=tier,
                    guard=detector,
                    lens=self.private,
                ),
            )
            node_shell.post(events.Restored(tuple(unfinished)))
            self.metrics.job_usage.source = node_shell.usage
            self._listed(node_shell, listing)
            scheduling = build_scheduler(
                config,
                store,
                signer,
                nodes,
                registry,
                node_shell.post,
                self._refused,
                on_plan=self.metrics.planned,
            )
            followed = (lambda: scheduling[1].followed) if scheduling else lambda: None
            self.metrics.sharing.watch(
                self.node,
                registry.jobs,
                followed,
                (lambda: scheduling[0].schedule) if scheduling else lambda: None,
            )
            commands = Commands(
                config,
                node=self.node,
                registry=registry,
                jobs=node_shell,
                logs=logs,
                cluster=nodes,
                peers=peers,
                schedule=followed,
            )
            # a job without a key: anyone could publish a node's peer key, so none is admitted
            # (its elasticrun shows this node's output only; no log is fetched from another)
            keyless = self.private is not None and self.private.keyless
            zap.add(PEER_DOMAIN, curve_policy((lambda: {}) if keyless else nodes.peer_keys))
            peer_server = RouterServer(
                ctx,
                f"tcp://{join_endpoint(self._address, config.node.peer_port)}",
                PeerCommands(commands),
                domain=PEER_DOMAIN,
                identify=PeerCaller,
                curve_secret=keys.secret,
                log_interval=config.log.summary_interval,
            )
            closing.callback(peer_server.close)
            zap.add(TIER_DOMAIN, curve_policy(nodes.peer_keys))
            bulk = join_endpoint(self._address, config.node.tier_bulk_port)
            tier_server = TierServer(
                ctx,
                f"tcp://{join_endpoint(self._address, config.node.tier_port)}",
                tier,
                curve_secret=keys.secret,
                bulk_endpoint=f"tcp://{bulk}",
                on_fault=self.faults.report,
            )
            closing.callback(tier_server.close)
            # the TCP ports first: a port in use stops start-up before the control socket exists
            with _listening("node.peer_port", join_endpoint(self._address, config.node.peer_port)):
                self._local.peer = (peer_server.bind(), keys.public.decode())
            with _listening("node.tier_port", join_endpoint(self._address, config.node.tier_port)):
                self._local.tier = tier_server.bind()
            with _listening("node.tier_bulk_port", bulk):
                tier_server.bind_bulk()
            if detector is not None:
                self._bind_detector(detector, self._local.peer[0])
                closing.callback(detector.close)
            if config.metrics.port:
                with _listening(
                    "metrics.port", join_endpoint(config.metrics.address, config.metrics.port)
                ):
                    closing.callback(
                        (
                            await self.metrics.serve(config.metrics.port, config.metrics.address)
                        ).close
                    )
            control = ControlServer(
                config.socket_path,
                commands,
                limits=self._control_limits(),
                on_request=self._count_request,
                on_connections=self.metrics.control_connections.set,
                world_accessible=os.getuid() == 0,
                log_interval=config.log.summary_interval,
            )
            control.bind()
            closing.callback(control.close)
            await asyncio.to_thread(
                cgroups.reap_leftovers
            )  # the socket says no other daemon runs here
            registry.subscribe(lambda record: self._jobs_changed(registry))
            registry.subscribe(tier.record_changed)
            self._local.jobs = node_shell
            duties = NodeDuties(
                local_record=self._local.record,
                post=node_shell.post,
                watcher=Watcher(
                    store=functools.partial(self._store_health, registry),
                    tick=functools.partial(self._ticked, nodes, detector),
                ),
            )
            pruner = Pruner(
                registry,
                config.log_dir,
                busy=node_shell.local_jobs,
                on_pruned=lambda job_ids: self._jobs_changed(registry),
            )
            self._install_signals()
            self._serving = True
            async with asyncio.TaskGroup() as tasks:
                loops: dict[str, Callable[[], Awaitable[None]]] = {
                    "zap": zap.serve,
                    "control": control.serve,
                    "peers": peer_server.serve,
                    "tier": tier_server.serve,
                    "checkpoints": tier.run,
                    "watchdog": self._watchdog,
                    "heartbeat": functools.partial(nodes.run, self.stop, duties),
                    "retention": pruner.run,
                }
                if detector is not None:
                    loops["detector"] = functools.partial(detector.run, self.stop)
                if config.history.retention:
                    sweeper = BoardSweeper(
                        board,
                        lambda: nodes.registry.observing,
                        config.history.retention,
                        told=Throttle(config.log.summary_interval),
                    )
                    loops["store-retention"] = functools.partial(sweeper.run, self.stop)
                if self._history is not None and config.store.compact_interval:
                    compactor = Compactor(
                        self._history,
                        lambda: nodes.registry.observing,
                        config.store.compact_interval,
                        told=Throttle(config.log.summary_interval),
                    )
                    loops["compaction"] = functools.partial(compactor.run, self.stop)
                if scheduling is not None:
                    loops["allocator"] = functools.partial(scheduling[0].run, self.stop)
                    loops["schedule"] = functools.partial(scheduling[1].run, self.stop)
                if nvml is not None and config.gpu.health_interval:
                    loops["gpu-health"] = functools.partial(
                        watch_gpus, nvml, config.gpu.health_interval, node_shell.post, self.stop
                    )
                if discovery is not None:
                    loops["discovery"] = functools.partial(
                        discovery.run, self.stop, functools.partial(self._listed, node_shell)
                    )
                # none of them ends the task group: one that raises is logged, counted, started again
                background = [
                    tasks.create_task(self.faults.supervise(name, run))
                    for name, run in loops.items()
                ]
                self._jobs_changed(registry)
                if await self._registered(nodes):
                    if reach := how_to_reach(
                        config.socket_path
                    ):  # logged before READY=1: told by then
                        log.info("not the default socket: reach this daemon with %s", reach)
                    self.notify.send("READY=1")
                    log.info(
                        "elasticd %s ready: node %s, socket %s, store %s",
                        __version__,
                        self.node,
                        config.socket_path,
                        self._endpoint,
                    )
                    if self.private is not None:
                        background.append(
                            tasks.create_task(
                                self.private.serve(
                                    store=store,
                                    signer=signer,
                                    root=Keyspace(config.cluster.name).root,
                                    node_shell=node_shell,
                                    registry=registry,
                                    nodes=nodes,
                                    stop=self.stop,
                                    node=self.node,
                                    endpoint=self._endpoint,
                                    hosts_store=self._server is not None,
                                )
                            )
                        )
                await node_shell.run(self.stop)
                for task in background:
                    task.cancel()
        log.info("elasticd stopped")
        return 0

    def _checkpoint_tier(
        self, links: TierLinks, post: Callable[[events.Event], None]
    ) -> CheckpointTier:
        """Each job's checkpoint directory in this node's memory, within the configured caps."""
        total = memory_total()
        try:
            node_cap = parse_memory(self.config.checkpoints.max_memory, total)
            job_cap = parse_memory(self.config.checkpoints.job_memory, total)
        except ValueError as exc:
            raise ConfigError("checkpoints", str(exc)) from None
        settings = TierSettings(self.node, tier_root(self.config), node_cap, job_cap)
        left = remove_leftovers(settings.root)
        if left:
            log.warning(
                "removed the checkpoints a previous run left here (jobs %s): a node keeps "
                "none across a restart; the other nodes hold their copies",
                ", ".join(left),
            )
        return CheckpointTier(settings, links, post, metrics=self.metrics)

    async def _open_store(self, closing: contextlib.AsyncExitStack) -> Store:
        """The cluster's store: a TCPStore hosted here or reached over TCP, or an etcd
        cluster; a standalone daemon's lives in its own memory (no port that any local user
        could reach)."""
        if self.config.standalone:
            self._endpoint = "memory (standalone)"
            return InstrumentedStore(AsyncMemoryStore(MemoryStore()), self.metrics)
        client: EtcdStore | TCPStoreClient
        if self.config.etcd:
            client = self._history = self._etcd_client()
        else:
            client = await self._tcpstore_client(closing)
        store = InstrumentedStore(client, self.metrics)
        closing.push_async_callback(store.close)
        await client.connect(self.config.store.connect_timeout)
        return store

    async def _tcpstore_client(self, closing: contextlib.AsyncExitStack) -> TCPStoreClient:
        try:
            self._server, self._endpoint = await asyncio.to_thread(host_store, self.config)
        except StoreConnectionError as exc:
            # torchrun's rule: a node that only guessed it hosts the store (its address is the
            # endpoint's) and cannot, joins the one that does (two nodes of a job on a host)
            if self.private is None or self.config.store.host != config_mod.AUTO:
                raise
            log.info("%s: joining it as a client", exc)
            self._server, self._endpoint = None, self.config.store.endpoint
        if self._server is not None:
            closing.callback(self._server.close)
        firewall = await asyncio.to_thread(
            store_firewall, self.config, self._endpoint, hosted=self._server is not None
        )
        if firewall is not None:
            closing.callback(firewall.close)
        return TCPStoreClient(self._endpoint, timeout=self.config.store.timeout)

    def _etcd_client(self) -> EtcdStore:
        """An etcd cluster's client: no store host, no firewall (etcd's TLS and users guard it)."""
        from elasticd.store.etcd import (
            EtcdStore,
        )  # grpc is loaded by the daemons of an etcd cluster only

        settings = self.config.store
        self._endpoint = ",".join(settings.endpoints)
        return EtcdStore(
            settings.endpoints,
            timeout=settings.timeout,
            ca_file=settings.ca_file,
            cert_file=settings.cert_file,
            key_file=settings.key_file,
            user=settings.user,
            password=settings.password(),
        )

    async def _registered(self, nodes: NodeService) -> bool:
        """Wait until this node's record is in the store (READY=1 means it joined the
        cluster); False if told to stop first."""
        name, _ = await race(joined=nodes.registered.wait(), stopping=self.stop.wait())
        return name == "joined"

    def _gpus(self) -> tuple[tuple[str, ...], Nvml | None]:
        """This node's GPUs; a private daemon's are those its elasticrun was given, if it was
        given some (CUDA_VISIBLE_DEVICES), their health not watched."""
        given = self.private.gpus() if self.private is not None else None
        if given is not None:
            return given, None
        return local_gpus(self.config.node.gpus)

    def _cgroups(self) -> JobCgroups:
        cgroups = JobCgroups.setup(
            instance_name(self.node, self.config.paths.state_dir), self.config.jobs.cgroup
        )
        if cgroups.available:
            log.info("%s", cgroups.description)
        return cgroups

    async def _node_registry(self, store: Store, signer: Signer) -> NodeRegistry:
        registry = NodeRegistry(
            store,
            signer,
            self.config.cluster.name,
            self.node,
            keep_alive=self.config.rendezvous.keep_alive,
            endpoint=self._endpoint,
            on_refused=self._refused,
        )
        # a fresh store is marked by its host; etcd has none, so every daemon offers the mark
        # (a compare-and-set on a missing key: the first one wins)
        if self._server is not None or self.config.standalone or self.config.etcd:
            await registry.create_epoch()
        return registry

    def _store_health(self, registry: JobRegistry, ok: bool, problem: str) -> None:
        self.metrics.store_up.set(1 if ok else 0)
        if self.private is not None:
            self.private.store_health(ok, problem, self.stop, self._endpoint)
        if ok != self._store_ok:
            self._store_ok = ok
            (log.info if ok else log.warning)(
                "store %s%s",
                self._endpoint,
                " reachable again" if ok else f" unreachable: {problem}",
            )
            self._jobs_changed(registry)

    def _board_store(self, ok: bool) -> None:
        self.metrics.store_up.set(1 if ok else 0)

    def _jobs_changed(self, registry: JobRegistry) -> None:
        """A job changed: the job gauges and the STATUS= line are recounted, from every
        job, at once after a quiet spell, else once RECOUNT_GAP has passed since the last
        recount.  A burst of changes (many submits, the board read whole) pays one recount
        per gap: one per change made 100 submits stall a daemon that held 10,000 jobs for
        a minute, its observer's duty included."""
        if self._recount is not None:
            return
        loop = asyncio.get_running_loop()
        wait = max(0.0, self._recounted + RECOUNT_GAP - loop.time())
        self._recount = loop.call_later(wait, self._recount_jobs, registry)

    def _recount_jobs(self, registry: JobRegistry) -> None:
        self._recount, self._recounted = None, asyncio.get_running_loop().time()
        self.metrics.count_jobs(registry.jobs(), self.node)
        self._update_status(registry)

    def _host_discovery(self) -> HostDiscovery | None:
        """The discovery script's runner (None: no script); it matches this node by its name
        or its address."""
        settings = self.config.discovery
        if not settings.script:
            return None
        return HostDiscovery(
            settings.script,
            interval=settings.interval,
            timeout=settings.timeout,
            names=(self.node, self._address),
            on_failure=lambda why: self.metrics.discovery_failures.inc(),
        )

    async def _discover_first(self, discovery: HostDiscovery | None) -> Listing:
        """The first run of the discovery script, before this node joins: one that fails
        stops start-up."""
        if discovery is None:
            return EVERYONE
        try:
            listing = await discovery.first()
        except UntrustedScript as exc:  # refused before it ran: not root's alone
            self.metrics.discovery_failures.inc()
            raise ConfigError("discovery.script", str(exc)) from None
        except DiscoveryFailed as exc:
            self.metrics.discovery_failures.inc()
            raise ConfigError("discovery.script", f"the first run failed: {exc}") from None
        log.info(
            "host discovery: node %s is %s",
            self.node,
            "not listed (it takes no job)"
            if not listing.listed
            else f"listed with {listing.slots} slots"
            if listing.slots
            else "listed",
        )
        return listing

    def _listed(self, node_shell: NodeShell, listing: Listing) -> None:
        self.metrics.node_listed.set(1 if listing.listed else 0)
        node_shell.set_listed(listing)

    def _update_status(self, registry: JobRegistry) -> None:
        line = status_line(registry.jobs(), self.node)
        if not self._store_ok:
            line += f"; store {self._endpoint} unreachable"
        self.notify.status(line)

    def _make_dirs(self) -> None:
        """State and runtime dirs of our own that nobody else can write (the state dir holds
        the cluster key; /tmp/elasticd-UID could have been made first by somebody else)."""
        paths = self.config.paths
        for key, path, mode in (
            ("paths.state_dir", paths.state_dir, 0o755),
            ("paths.state_dir", self.config.log_dir, 0o755),
            ("paths.runtime_dir", paths.runtime_dir, 0o755 if os.getuid() == 0 else 0o700),
        ):
            os.makedirs(path, mode=mode, exist_ok=True)
            if not is_own_dir(path):
                info = os.lstat(path)
                raise ConfigError(
                    key,
                    f"refusing {path}: it must be a directory owned by uid "
                    f"{os.geteuid()} that nobody else can write (it is uid "
                    f"{info.st_uid}, mode {stat.filemode(info.st_mode)})",
                )

    def _restrict_earlier_logs(self) -> None:
        """Jobs' files that an earlier version left readable by their group (0640) are no
        longer: that group may be other users' too."""
        restricted = restrict_earlier(self.config.log_dir)
        if restricted:
            log.info(
                "%d files of earlier jobs in %s that the job's group could read are "
                "0600 now (elasticctl logs serves them)",
                restricted,
                self.config.log_dir,
            )

    def _detector(self, cluster_key: bytes, lost: Callable[[str], None]) -> DetectorService | None:
        """The failure detector (cluster/detector.py), unless standalone or turned off."""
        config = self.config
        if config.standalone or not config.detector.enabled:
            return None
        return DetectorService(
            self.node,
            subkey(cluster_key, "detector", config.cluster.name),
            settings=config.detector.settings,
            boot=next_boot(os.path.join(config.paths.state_dir, "detector.boot")),
            on_lost=lambda node, silent: lost(node),
            max_rate=config.detector.max_rate,
            metrics=self.metrics,
            log_interval=config.log.summary_interval,
        )

    def _bind_detector(self, detector: DetectorService, peer_endpoint: str) -> None:
        """UDP at the peer port's number; a daemon that cannot bind it runs on heartbeats."""
        address = udp_endpoint(peer_endpoint)
        try:
            if address is None:
                raise OSError(f"no address in {peer_endpoint!r}")
            detector.bind(*address)
        except OSError as exc:
            log.warning(
                "the failure detector cannot listen on UDP %s (%s): lost nodes are found by "
                "heartbeats only",
                peer_endpoint,
                exc,
            )
        else:
            log.info("failure detector on UDP %s:%d", *address)

    def _ticked(self, nodes: NodeService, detector: DetectorService | None) -> None:
        """After each heartbeat duty: the node tally, and the nodes the detector may reach
        (when the duty changed what it knows)."""
        self.metrics.count_nodes(nodes.tally())
        sightings = nodes.sightings
        if detector is None or sightings is self._detector_learned:
            return
        self._detector_learned = sightings
        states = nodes.states()
        detector.learn(
            {
                name: address
                for name, s in sightings.items()
                if name != self.node
                and states.get(name) is not NodeState.LOST
                and (address := udp_endpoint(s.record.peer_endpoint)) is not None
            }
        )

    _detector_learned: object = None

    def _cluster_key(self) -> bytes:
        """Standalone daemons and the store host make a key if there is none; others need one."""
        if self.config.standalone or hosts_store(self.config):
            return load_or_create_key(self.config.key_file)
        return load_key(self.config.key_file)

    @functools.cached_property
    def _address(self) -> str:
        return self.config.node.address or route_address(self.config.store_host)

    def _restore(self, registry: JobRegistry, history: History) -> list[JobRecord]:
        """Jobs a previous run left unfinished: their leftovers killed (what happened to them
        is the node core's to say: events.Restored)."""
        unfinished = registry.restore(history.load())
        self.metrics.history_skipped.inc(registry.skipped)
        self.metrics.known_finished(registry.jobs())
        killed = reap_leftovers(worker_groups(unfinished, self.node))
        if killed:
            log.warning("killed %d leftover worker processes of a previous run", killed)
        return unfinished

    def _refused(self, key: str, why: str) -> None:
        """A store record no daemon acts on: counted every time, logged once per
        ``log.summary_interval`` per key (a poisoned key is read at every heartbeat)."""
        self.metrics.refused_records.inc()
        held = self._refusals.check(key, time.monotonic())
        if held is not None:
            log.warning("refused store record %s: %s%s", key, why, held_back(held))

    def _control_limits(self) -> ConnectionLimits:
        """The configured connection limits, kept well inside the file-descriptor limit (the
        rest is for workers' pipes and logs, store connections and peers)."""
        control = self.config.control
        budget = max(16, raise_fd_limit() // 4)
        if control.max_connections > budget:
            log.warning(
                "control.max_connections = %d lowered to %d: the file-descriptor limit "
                "is %d (raise LimitNOFILE)",
                control.max_connections,
                budget,
                budget * 4,
            )
        return ConnectionLimits(
            connections=min(control.max_connections, budget),
            connections_per_user=control.max_connections_per_user,
        )

    def _count_request(self, op: str, result: str) -> None:
        self.metrics.control_requests.labels(op, result).inc()

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if not self.stop.is_set():
            log.info("%s: stopping", sig.name)
            self.notify.send("STOPPING=1")
            self.stop.set()

    async def _watchdog(self) -> None:
        """WATCHDOG=1 from the event loop itself, so a wedged loop gets us restarted."""
        interval = self.notify.watchdog_interval()
        if interval is None:
            return
        while True:
            self.notify.send("WATCHDOG=1")
            await asyncio.sleep(interval)


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard one; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


@contextlib.contextmanager
def _listening(key: str, where: str) -> Iterator[None]:
    """A port that cannot be bound is a configuration error naming its key, not a traceback."""
    try:
        yield
    except (OSError, zmq.ZMQError) as exc:
        raise ConfigError(key, f"cannot listen on {where}: {exc}") from exc
