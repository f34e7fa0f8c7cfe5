"""``elasticd --clean-up``: what a daemon that died without closing (SIGKILL, the OOM killer)
left on this host, removed: its workers and their descendants, its job cgroups, its store
firewall table.  A daemon that starts again does the first two itself; a node that never
comes back needs this, and systemd runs it after every stop (``ExecStopPost=``).

It is given the daemon's own options (node name, state directory, cluster, cgroup setting)
and must run where the daemon ran: under systemd, in its unit.  It refuses while a daemon
answers on the control socket: that daemon's jobs are its own.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from elasticd.config import DaemonConfig
from elasticd.control.server import served
from elasticd.core.records import worker_groups
from elasticd.jobs.history import History
from elasticd.jobs.history import path_in as history_path
from elasticd.jobs.registry import JobRegistry
from elasticd.shell.cgroup_placement import instance_name
from elasticd.shell.cgroups import JobCgroups
from elasticd.shell.checkpoints import remove_leftovers, tier_root
from elasticd.shell.workers import reap_leftovers
from elasticd.store.firewall import remove_table, table_name

log = logging.getLogger(__name__)


class DaemonRunning(Exception):
    """A daemon answers on the control socket: nothing of its is touched."""


@dataclass
class CleanedUp:
    workers: int = 0  # processes killed in the workers' process groups
    cgroup_processes: int = 0  # processes killed in job cgroups
    cgroups: list[str] = field(default_factory=list)  # the job cgroups removed
    table: str = ""  # the nftables table removed ("" none was there)
    checkpoints: list[str] = field(default_factory=list)  # jobs whose checkpoints were removed

    def summary(self, node: str) -> str:
        done = [f"killed {self.workers + self.cgroup_processes} leftover processes"]
        if self.cgroups:
            done.append(f"removed job cgroups {' '.join(self.cgroups)}")
        if self.checkpoints:
            done.append(f"removed the checkpoints of jobs {' '.join(self.checkpoints)}")
        done.append(
            f"removed nftables table inet {self.table}" if self.table else "no firewall table left"
        )
        return f"node {node}: " + "; ".join(done)


def clean_up(config: DaemonConfig) -> CleanedUp:
    """Remove what a dead daemon of ``config`` left here; raises DaemonRunning if one runs."""
    if served(config.socket_path):
        raise DaemonRunning(
            f"a daemon answers on {config.socket_path}: stop it first (it cleans up after itself)"
        )
    node = config.node_name
    done = CleanedUp()
    done.workers = _reap_workers(config, node)
    cgroups = JobCgroups.setup(instance_name(node, config.paths.state_dir), config.jobs.cgroup)
    if cgroups.available:
        done.cgroups = cgroups.leftovers()
        done.cgroup_processes = cgroups.reap_leftovers()
        cgroups.close()
    if not config.standalone and not config.etcd and config.store.firewall is not False:
        table = table_name(config.cluster.name, node)
        if remove_table(table):
            done.table = table
    done.checkpoints = remove_leftovers(tier_root(config))
    return done


def _reap_workers(config: DaemonConfig, node: str) -> int:
    """The process groups of the workers that the history says ran here, unfinished (read
    as the daemon's start reads it: a row it cannot take is skipped with a warning)."""
    path = history_path(config.paths.state_dir)
    if not os.path.exists(path):
        return 0
    history = History(path)
    try:
        unfinished = JobRegistry(history).restore(history.load())
    finally:
        history.close()
    return reap_leftovers(worker_groups(unfinished, node))
