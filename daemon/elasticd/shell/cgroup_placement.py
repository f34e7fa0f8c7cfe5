"""Where job cgroups go: pure functions of ``/proc/self/mountinfo``, ``/proc/self/cgroup``
and the environment (see :mod:`elasticd.shell.cgroups` for what the daemon does there).

``find_hierarchy`` reads where cgroup2 (and a hybrid host's v1 memory and pids) are mounted
and which cgroups this process is in; ``home_cgroup`` which of them the daemon works in;
``choose_placement`` the base directory for job cgroups, or why there is none;
``instance_name`` what names this daemon's job cgroups.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

AUTO = "auto"
OFF = "off"
NAME = re.compile(r"[\w.-]+", re.ASCII)  # a node's or a job's name, as it may name a cgroup
TWINS = ("memory", "pids")  # a hybrid host may have these in cgroup v1 only
DISABLED = f"disabled by jobs.cgroup = {OFF}"
DAEMON_LEAF = "daemon"


@dataclass(frozen=True)
class Hierarchy:
    """This process's cgroups, as paths in their hierarchies, and where those are mounted."""

    v2_mount: str | None = None  # mount point of cgroup2
    v2_root: str = "/"  # the cgroup that is the mount's root
    own: str | None = None  # our v2 cgroup, e.g. "/system.slice/elasticd.service"
    v1_memory: str | None = None  # directory of our cgroup v1 memory cgroup
    v1_pids: str | None = None  # directory of our cgroup v1 pids cgroup

    def v1_dirs(self) -> dict[str, str]:
        """Our cgroup v1 directory of each controller a job cgroup may need a twin for."""
        return {
            name: path
            for name, path in (("memory", self.v1_memory), ("pids", self.v1_pids))
            if path
        }

    def v2_dir(self, cgroup: str) -> str | None:
        """The directory of a v2 cgroup, or None when the mount does not show it."""
        return _dir_under(self.v2_mount, self.v2_root, cgroup)


@dataclass(frozen=True)
class Placement:
    """The decision of ``setup``: a base directory for job cgroups, or why there is none."""

    base: str | None = None
    reason: str = ""
    systemd: bool = False  # base is our delegated unit: move into <base>/daemon, never remove it
    v1_bases: Mapping[str, str] = field(
        default_factory=dict
    )  # controller -> where its v1 twins go, if v2 lacks it
    top: str | None = (
        None  # the outermost cgroup whose subtree_control we may write (base: the same)
    )


def instance_name(node: str, state_dir: str) -> str:
    """What names this daemon's job cgroups: its node and a digest of its state directory.
    Two daemons of one node name on a host (root's ``--standalone`` beside the system
    daemon, concurrent test runs) never share one, whose start would kill the other's jobs;
    a restarted daemon, same state directory, finds what it left."""
    digest = hashlib.sha256(os.path.realpath(state_dir).encode()).hexdigest()[:6]
    return f"{node}-{digest}"


def find_hierarchy(mountinfo: str, proc_cgroup: str) -> Hierarchy:
    v2 = None
    v1: dict[str, tuple[str, str]] = {}  # controller -> (mount point, the cgroup it shows)
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup2" and v2 is None:
            v2 = (_unescape(fields[4]), _unescape(fields[3]))
        elif fstype == "cgroup":
            for name in TWINS:
                if name in options:
                    v1.setdefault(name, (_unescape(fields[4]), _unescape(fields[3])))
    own = None
    own_v1: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and not controllers:
            own = path
        for name in controllers.split(","):
            if name in TWINS:
                own_v1[name] = path
    dirs = {
        name: _dir_under(*v1[name], own_v1[name]) for name in TWINS if name in v1 and name in own_v1
    }
    return Hierarchy(
        v2_mount=v2[0] if v2 else None,
        v2_root=v2[1] if v2 else "/",
        own=own,
        v1_memory=dirs.get("memory"),
        v1_pids=dirs.get("pids"),
    )


def home_cgroup(hierarchy: Hierarchy, environ: Mapping[str, str]) -> tuple[str | None, bool]:
    """(the v2 cgroup we work in, whether it is our systemd unit's).

    A daemon that already moved into ``<unit>/daemon`` still counts its unit as home.
    """
    own = hierarchy.own
    if own is None:
        return None, False
    if "INVOCATION_ID" in environ and own.strip("/"):
        parent, leaf = own.rstrip("/").rsplit("/", 1)
        if leaf == DAEMON_LEAF and parent.endswith(".service"):
            return parent, True
        if leaf.endswith(".service"):
            return own, True
    return own, False


def choose_placement(
    hierarchy: Hierarchy,
    setting: str,
    node: str,
    environ: Mapping[str, str],
    *,
    delegated: bool,
    writable: bool,
) -> Placement:
    """Where job cgroups go.  ``delegated`` and ``writable`` are facts about the home cgroup
    (see ``home_cgroup``): systemd delegated it to us; we may create cgroups in it."""
    if setting == OFF:
        return Placement(reason=DISABLED)
    if not NAME.fullmatch(node):
        return Placement(reason=f"node name {node!r} cannot name a cgroup")
    mount = hierarchy.v2_mount
    if mount is None:
        return Placement(reason="no cgroup2 mount")
    v1_bases = {
        name: os.path.join(path, f"elasticd-{node}") for name, path in hierarchy.v1_dirs().items()
    }
    if setting != AUTO:
        if not setting.startswith("/") or ".." in setting.split("/"):
            return Placement(
                reason=f"jobs.cgroup = {setting!r}: must be '{AUTO}', '{OFF}' or "
                f"an absolute cgroup path such as /elasticd"
            )
        return Placement(base=_join_cgroup(mount, setting), v1_bases=v1_bases, top=mount)
    cgroup, systemd = home_cgroup(hierarchy, environ)
    home = hierarchy.v2_dir(cgroup) if cgroup is not None else None
    if home is None:
        return Placement(
            reason=f"our cgroup {cgroup or '(none)'} is not visible under the cgroup2 mount {mount}"
        )
    if systemd:
        if not delegated:
            return Placement(
                reason=f"{home} is not delegated to elasticd: under systemd, set Delegate=yes"
            )
        return Placement(base=home, systemd=True, v1_bases=v1_bases, top=home)
    if not writable:
        return Placement(
            reason=f"{home} is not writable: run elasticd as root, or under "
            f"systemd with Delegate=yes"
        )
    return Placement(base=os.path.join(home, f"elasticd-{node}"), v1_bases=v1_bases, top=home)


def _dir_under(mount: str | None, mount_root: str, cgroup: str) -> str | None:
    if mount is None:
        return None
    root = mount_root.rstrip("/")
    if cgroup != root and not cgroup.startswith(root + "/"):
        return None
    return _join_cgroup(mount, cgroup[len(root) :])


def _join_cgroup(mount: str, cgroup: str) -> str:
    return os.path.normpath(mount + "/" + cgroup.strip("/")) if cgroup.strip("/") else mount


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)
