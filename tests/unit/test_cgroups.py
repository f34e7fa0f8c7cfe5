"""Job cgroups: the placement decision table by table, then the real cgroupfs (as root).

The real tests make their cgroups under a node name of their own and remove them, so they
can run next to a daemon and next to each other.
"""

import asyncio
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from uuid import uuid4

import psutil
import pytest

from elasticd.core.containment import V2, JobLimits
from elasticd.shell import cgroups as cgroups_mod
from elasticd.shell.cgroup_placement import Hierarchy, choose_placement, find_hierarchy, home_cgroup
from elasticd.shell.cgroups import JobCgroup, JobCgroups, Usage, limit_writes

HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
PURE_V2_MOUNTINFO = (
    "30 23 0:27 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
)
NO_CGROUP_MOUNTINFO = "22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
BIND_MOUNTINFO = "41 31 0:38 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
SPACE_MOUNTINFO = r"41 31 0:38 / /mnt/my\040cgroups rw - cgroup2 cgroup2 rw" + "\n"

SERVICE = "0::/system.slice/elasticd.service\n"
HYBRID_SELF = "9:name=systemd:/\n8:pids:/\n4:memory:/process_api/af62\n0::/\n"
SYSTEMD = {"INVOCATION_ID": "0123"}


@pytest.mark.parametrize(
    "mountinfo, proc_cgroup, expected",
    [
        (
            HYBRID_MOUNTINFO,
            HYBRID_SELF,
            Hierarchy(
                "/sys/fs/cgroup/unified",
                "/",
                "/",
                "/sys/fs/cgroup/memory/process_api/af62",
                "/sys/fs/cgroup/pids",
            ),
        ),
        (
            HYBRID_MOUNTINFO,
            "4:memory:/process_api/af62\n0::/\n",  # no pids line: no pids twin
            Hierarchy("/sys/fs/cgroup/unified", "/", "/", "/sys/fs/cgroup/memory/process_api/af62"),
        ),
        (
            PURE_V2_MOUNTINFO,
            SERVICE,
            Hierarchy("/sys/fs/cgroup", "/", "/system.slice/elasticd.service"),
        ),
        (NO_CGROUP_MOUNTINFO, "0::/\n", Hierarchy(None, "/", "/")),
        (
            BIND_MOUNTINFO,
            "0::/kubepods/pod1/c1\n",
            Hierarchy("/sys/fs/cgroup", "/kubepods/pod1", "/kubepods/pod1/c1"),
        ),
        (SPACE_MOUNTINFO, "0::/\n", Hierarchy("/mnt/my cgroups", "/", "/")),
        ("", "", Hierarchy()),
    ],
)
def test_find_hierarchy(mountinfo, proc_cgroup, expected):
    assert find_hierarchy(mountinfo, proc_cgroup) == expected


@pytest.mark.parametrize(
    "hierarchy, cgroup, directory",
    [
        (Hierarchy("/sys/fs/cgroup", "/", "/"), "/", "/sys/fs/cgroup"),
        (Hierarchy("/sys/fs/cgroup", "/", "/"), "/a/b", "/sys/fs/cgroup/a/b"),
        (
            Hierarchy("/sys/fs/cgroup", "/kubepods/pod1", "/"),
            "/kubepods/pod1/c1",
            "/sys/fs/cgroup/c1",
        ),
        (Hierarchy("/sys/fs/cgroup", "/kubepods/pod1", "/"), "/kubepods/pod1", "/sys/fs/cgroup"),
        (Hierarchy("/sys/fs/cgroup", "/kubepods/pod1", "/"), "/kubepods/pod10", None),
        (Hierarchy(None, "/", "/"), "/", None),
    ],
)
def test_v2_dir(hierarchy, cgroup, directory):
    assert hierarchy.v2_dir(cgroup) == directory


HYBRID = find_hierarchy(HYBRID_MOUNTINFO, HYBRID_SELF)
UNDER_SYSTEMD = find_hierarchy(PURE_V2_MOUNTINFO, SERVICE)
MOVED_TO_LEAF = find_hierarchy(PURE_V2_MOUNTINFO, "0::/system.slice/elasticd.service/daemon\n")
IN_A_SCOPE = find_hierarchy(PURE_V2_MOUNTINFO, "0::/user.slice/user-0.slice/session-3.scope\n")
NOT_VISIBLE = find_hierarchy(BIND_MOUNTINFO, "0::/other\n")
UNIT = "/sys/fs/cgroup/system.slice/elasticd.service"


@pytest.mark.parametrize(
    "hierarchy, setting, environ, delegated, writable, base, text",
    [
        (HYBRID, "off", {}, True, True, None, "disabled by jobs.cgroup = off"),
        (
            find_hierarchy(NO_CGROUP_MOUNTINFO, "0::/\n"),
            "auto",
            {},
            True,
            True,
            None,
            "no cgroup2 mount",
        ),
        (HYBRID, "auto", {}, False, True, "/sys/fs/cgroup/unified/elasticd-n1", ""),
        (HYBRID, "auto", {}, False, False, None, "/sys/fs/cgroup/unified is not writable"),
        (UNDER_SYSTEMD, "auto", SYSTEMD, True, True, UNIT, ""),
        (UNDER_SYSTEMD, "auto", SYSTEMD, False, True, None, "set Delegate=yes"),
        (MOVED_TO_LEAF, "auto", SYSTEMD, True, True, UNIT, ""),
        # the same cgroups, not started by systemd (INVOCATION_ID unset): a subtree of our own
        (UNDER_SYSTEMD, "auto", {}, False, True, f"{UNIT}/elasticd-n1", ""),
        # a login session is no service: no delegation needed, our cgroup must be writable
        (
            IN_A_SCOPE,
            "auto",
            SYSTEMD,
            False,
            True,
            "/sys/fs/cgroup/user.slice/user-0.slice/session-3.scope/elasticd-n1",
            "",
        ),
        (NOT_VISIBLE, "auto", {}, True, True, None, "is not visible under the cgroup2 mount"),
        (UNDER_SYSTEMD, "/elasticd", SYSTEMD, False, False, "/sys/fs/cgroup/elasticd", ""),
        (HYBRID, "/jobs/elasticd/", {}, False, False, "/sys/fs/cgroup/unified/jobs/elasticd", ""),
        (
            HYBRID,
            "elasticd",
            {},
            True,
            True,
            None,
            "must be 'auto', 'off' or an absolute cgroup path",
        ),
        (HYBRID, "/a/../../etc", {}, True, True, None, "must be 'auto', 'off' or an absolute"),
    ],
)
def test_choose_placement(hierarchy, setting, environ, delegated, writable, base, text):
    placement = choose_placement(
        hierarchy, setting, "n1", environ, delegated=delegated, writable=writable
    )
    assert placement.base == base
    assert text in placement.reason
    assert bool(placement.reason) is (base is None)
    assert placement.systemd is (base == UNIT)


def test_placement_details():
    hybrid = choose_placement(HYBRID, "auto", "n1", {}, delegated=False, writable=True)
    assert hybrid.v1_bases == {
        "memory": "/sys/fs/cgroup/memory/process_api/af62/elasticd-n1",
        "pids": "/sys/fs/cgroup/pids/elasticd-n1",
    }
    assert hybrid.top == "/sys/fs/cgroup/unified"  # our own cgroup: enable controllers from there
    unit = choose_placement(UNDER_SYSTEMD, "auto", "n1", SYSTEMD, delegated=True, writable=True)
    assert unit.v1_bases == {} and unit.top == UNIT  # pure v2; nothing above the unit is ours
    explicit = choose_placement(UNDER_SYSTEMD, "/a/b", "n1", {}, delegated=False, writable=False)
    assert explicit.top == "/sys/fs/cgroup"  # the administrator's path, from the root down
    assert (
        "cannot name a cgroup"
        in choose_placement(HYBRID, "auto", "a/b", {}, delegated=True, writable=True).reason
    )
    assert home_cgroup(MOVED_TO_LEAF, SYSTEMD) == ("/system.slice/elasticd.service", True)
    assert home_cgroup(MOVED_TO_LEAF, {}) == ("/system.slice/elasticd.service/daemon", False)


@pytest.mark.parametrize("usage", [Usage(), Usage(1.5, 2 << 30, 0), Usage(cpu_seconds=0.25)])
def test_usage_round_trip(usage):
    assert Usage.from_json(json.loads(json.dumps(usage.to_json()))) == usage


@pytest.mark.parametrize(
    "doc, usage",
    [
        ({}, Usage()),
        (None, Usage()),
        ([], Usage()),
        ({"cpu_seconds": 3, "memory_peak": 1.0e9, "extra": 1}, Usage(3.0, 1_000_000_000)),
        ({"cpu_seconds": "3", "memory_peak": True, "oom_kills": 2}, Usage(oom_kills=2)),
        ({"cpu_seconds": float("nan"), "memory_peak": float("inf")}, Usage()),
    ],
)
def test_usage_from_json_is_tolerant(doc, usage):
    assert Usage.from_json(doc) == usage


# --- setup against a fake /proc and a fake cgroup tree ---


def _fake_proc(tmp_path: Path, mountinfo: str, proc_cgroup: str) -> str:
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "mountinfo").write_text(mountinfo)
    (tmp_path / "proc" / "self" / "cgroup").write_text(proc_cgroup)
    return str(tmp_path / "proc")


def test_setup_off_and_without_cgroup2(tmp_path):
    off = JobCgroups.setup("n1", "off")
    assert (off.available, off.reason) == (False, "disabled by jobs.cgroup = off")
    assert off.create("j-1") is None
    assert off.reap_leftovers() == 0
    off.close()
    none = JobCgroups.setup("n1", proc=_fake_proc(tmp_path, NO_CGROUP_MOUNTINFO, "0::/\n"))
    assert (none.available, none.reason) == (False, "no cgroup2 mount")
    missing = JobCgroups.setup("n1", proc=str(tmp_path / "nowhere"))
    assert not missing.available and "cannot read" in missing.reason


def test_setup_under_systemd_without_delegation(tmp_path):
    unit = tmp_path / "cg" / "system.slice" / "elasticd.service"
    unit.mkdir(parents=True)
    (unit / "cgroup.subtree_control").write_text("")
    mountinfo = f"41 31 0:38 / {tmp_path}/cg rw,relatime - cgroup2 cgroup2 rw\n"
    cgroups = JobCgroups.setup("n1", environ=SYSTEMD, proc=_fake_proc(tmp_path, mountinfo, SERVICE))
    assert not cgroups.available
    assert cgroups.reason == f"{unit} is not delegated to elasticd: under systemd, set Delegate=yes"
    assert os.listdir(unit) == ["cgroup.subtree_control"]  # nothing made, nothing moved


def test_setup_that_fails_says_where(tmp_path):
    """A plain directory is no cgroup: making the base works, enabling controllers fails."""
    mountinfo = f"41 31 0:38 / {tmp_path}/cg rw,relatime - cgroup2 cgroup2 rw\n"
    (tmp_path / "cg").mkdir()
    cgroups = JobCgroups.setup("n1", "/elasticd", proc=_fake_proc(tmp_path, mountinfo, "0::/\n"))
    assert not cgroups.available
    assert cgroups.reason.startswith(f"cannot set up job cgroups in {tmp_path}/cg/elasticd: ")


class FakeKernel:
    """cgroup v2's rules for ``cgroup.subtree_control``, over plain directories: a cgroup is
    offered what its parent enabled (the root: what the kernel has), and a non-root cgroup
    with processes of its own refuses to enable any (EBUSY)."""

    def __init__(
        self, root: Path, offered: str, busy: tuple[str, ...] = (), on: dict[str, str] | None = None
    ) -> None:
        self.root = str(root)
        self.offered = offered.split()
        self.busy = {f"{root}{cgroup}" for cgroup in busy}
        self.on = {
            f"{root}{cgroup}".rstrip("/"): names.split() for cgroup, names in (on or {}).items()
        }
        self.real_read = cgroups_mod._read

    def read(self, path: str) -> str:
        directory, name = os.path.split(path)
        if not directory.startswith(self.root):
            return self.real_read(path)
        if name == "cgroup.controllers":
            offered = (
                self.offered
                if directory == self.root
                else self.on.get(os.path.dirname(directory), [])
            )
            return " ".join(offered) + "\n"
        assert name == "cgroup.subtree_control", path
        return " ".join(self.on.get(directory, [])) + "\n"

    def write(self, path: str, text: str) -> None:
        directory, name = os.path.split(path)
        assert name == "cgroup.subtree_control" and text.startswith("+"), (path, text)
        if text[1:] not in self.read(f"{directory}/cgroup.controllers").split():
            raise OSError(errno.ENOENT, os.strerror(errno.ENOENT))
        if directory in self.busy:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        self.on.setdefault(directory, []).append(text[1:])


@pytest.mark.parametrize(
    "own, setting, offered, busy, on, controls, lacking",
    [
        # the root cgroup may enable anything: every controller reaches the job cgroups
        ("/", "auto", "cpu io memory pids", (), {}, {"memory": V2, "pids": V2}, {}),
        # our own cgroup has processes (ours): the kernel refuses to enable controllers in it
        (
            "/svc",
            "auto",
            "cpu io memory pids",
            ("/svc",),
            {"/": "memory pids"},
            {},
            {
                "memory": "cannot enable it in {root}/svc/cgroup.subtree_control: Device or resource busy",
                "pids": "cannot enable it in {root}/svc/cgroup.subtree_control: Device or resource busy",
            },
        ),
        # ... unless someone enabled them there before it had processes
        (
            "/svc",
            "auto",
            "cpu io memory pids",
            ("/svc",),
            {"/": "memory pids", "/svc": "pids"},
            {"pids": V2},
            {"memory": "cannot enable it in {root}/svc/cgroup.subtree_control"},
        ),
        # a hybrid host: the controllers are bound to cgroup v1, and no v1 tree is mounted here
        (
            "/",
            "auto",
            "hugetlb",
            (),
            {},
            {},
            {
                "pids": "{root} does not offer it (cgroup.controllers: hugetlb); no cgroup v1 "
                "hierarchy has it either"
            },
        ),
        # an administrator's path: enabled from the root down, past our busy cgroup
        ("/svc", "/jobs/elasticd", "memory pids", ("/svc",), {}, {"memory": V2, "pids": V2}, {}),
    ],
)
def test_controllers_are_enabled_down_to_the_job_cgroups(
    tmp_path, monkeypatch, own, setting, offered, busy, on, controls, lacking
):
    root = tmp_path / "cg"
    (root / own.strip("/")).mkdir(parents=True)
    kernel = FakeKernel(root, offered, busy, on)
    monkeypatch.setattr(cgroups_mod, "_read", kernel.read)
    monkeypatch.setattr(cgroups_mod, "_write", kernel.write)
    mountinfo = f"41 31 0:38 / {root} rw,relatime - cgroup2 cgroup2 rw\n"
    cgroups = JobCgroups.setup("n1", setting, proc=_fake_proc(tmp_path, mountinfo, f"0::{own}\n"))
    assert cgroups.available, cgroups.reason
    assert cgroups.controls == controls
    assert set(cgroups.lacking) == set(lacking) | (
        {"memory", "pids"} - set(controls) - set(lacking)
    )
    for name, why in lacking.items():
        assert cgroups.lacking[name].startswith(why.format(root=root)), cgroups.lacking[name]


def test_chain():
    assert cgroups_mod._chain("/cg", "/cg") == ["/cg"]
    assert cgroups_mod._chain("/cg", "/cg/a/b") == ["/cg", "/cg/a", "/cg/a/b"]


@pytest.mark.parametrize(
    "enabled, twins, limits, writes",
    [
        (
            ("cpu", "memory", "pids"),
            {},
            JobLimits(pids=64, memory=1 << 30),
            [
                ("/j/pids.max", "64", True),
                ("/j/memory.oom.group", "1", False),
                ("/j/memory.max", str(1 << 30), True),
                ("/j/memory.swap.max", "0", False),
            ],
        ),
        (
            ("memory", "pids"),
            {},
            JobLimits(),
            [  # no limit: "max", so that a reused cgroup keeps none
                ("/j/pids.max", "max", True),
                ("/j/memory.oom.group", "1", False),
                ("/j/memory.max", "max", True),
                ("/j/memory.swap.max", "max", False),
            ],
        ),
        (
            (),
            {"pids": "/v1p/j", "memory": "/v1m/j"},
            JobLimits(pids=64, memory=1 << 30),
            [
                ("/v1p/j/pids.max", "64", True),
                ("/v1m/j/memory.memsw.limit_in_bytes", "-1", False),
                ("/v1m/j/memory.limit_in_bytes", str(1 << 30), True),
                ("/v1m/j/memory.memsw.limit_in_bytes", str(1 << 30), False),
            ],
        ),
        (
            ("pids",),
            {"memory": "/v1m/j"},
            JobLimits(pids=64),
            [
                ("/j/pids.max", "64", True),
                ("/v1m/j/memory.memsw.limit_in_bytes", "-1", False),
                ("/v1m/j/memory.limit_in_bytes", "-1", True),
                ("/v1m/j/memory.memsw.limit_in_bytes", "-1", False),
            ],
        ),
        (
            (),
            {},
            JobLimits(pids=64, memory=1 << 30),
            [],
        ),  # nothing to write with: containment.py says so
    ],
)
def test_limit_writes(enabled, twins, limits, writes):
    assert limit_writes("/j", enabled, twins, limits) == writes


# --- the real cgroupfs ---


def _real_hierarchy() -> Hierarchy:
    with open("/proc/self/mountinfo") as mountinfo, open("/proc/self/cgroup") as own:
        return find_hierarchy(mountinfo.read(), own.read())


_NO_CGROUPFS = os.geteuid() != 0 or _real_hierarchy().v2_mount is None


def needs_cgroupfs(test):
    skip = pytest.mark.skipif(
        _NO_CGROUPFS, reason="needs root and a cgroup2 mount: the test makes real cgroups"
    )
    return pytest.mark.root(skip(test))


def _node() -> str:
    return f"t{os.getpid()}-{uuid4().hex[:6]}"


class Box:
    """JobCgroups and children made by one test, all killed and removed afterwards."""

    def __init__(self) -> None:
        self.node = _node()
        self.made: list[JobCgroups] = []
        self.children: list[subprocess.Popen] = []

    def setup(self, setting: str = "auto") -> JobCgroups:
        cgroups = JobCgroups.setup(self.node, setting)
        self.made.append(cgroups)
        return cgroups

    def spawn(self, job, argv, **kwargs) -> subprocess.Popen:
        fds = job.join_fds()
        try:
            child = subprocess.Popen(
                argv, preexec_fn=lambda: [os.write(fd, b"0") for fd in fds], **kwargs
            )
        finally:
            for fd in fds:
                os.close(fd)
        self.children.append(child)
        return child

    def python(self, job, code: str, **kwargs) -> subprocess.Popen:
        return self.spawn(job, [sys.executable, "-c", code], **kwargs)

    def clean(self) -> None:
        for cgroups in reversed(self.made):
            cgroups.reap_leftovers()
        for child in self.children:
            child.kill()
            child.wait()
        for cgroups in reversed(self.made):
            cgroups.close()


@pytest.fixture
def box():
    made = Box()
    yield made
    made.clean()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]

# forks until a fork fails (or 200 succeed), prints how many and why, then waits for its end
FORK_BOMB = """
import errno, os, signal, sys
forked = 0
failed = "none"
for _ in range(200):
    try:
        pid = os.fork()
    except OSError as exc:
        failed = errno.errorcode.get(exc.errno, str(exc.errno))
        break
    if pid == 0:
        signal.pause()
        os._exit(0)
    forked += 1
print(forked, failed, flush=True)
signal.pause()
"""

DOUBLE_FORK = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        print(os.getpid(), flush=True)
        time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


@needs_cgroupfs
def test_a_spawned_child_is_in_the_job(box):
    cgroups = box.setup()
    assert cgroups.available, cgroups.reason
    assert cgroups.base in cgroups.description
    job = cgroups.create("j-1a2b3c")
    assert os.path.isdir(job.path) and job.path == f"{cgroups.base}/job-j-1a2b3c"
    assert not job.populated()
    child = box.spawn(job, SLEEP)
    assert job.pids() == [child.pid]
    assert job.populated()
    for twin in job.v1.values():  # a hybrid host: the v1 twins (memory, pids) too
        assert open(f"{twin}/cgroup.procs").read().split() == [str(child.pid)]


@needs_cgroupfs
def test_a_child_that_dropped_to_another_user_still_joins(box):
    """The kernel checks who opened cgroup.procs (the daemon), not who writes to it."""
    job = box.setup().create("j-user")
    child = box.spawn(job, ["sleep", "60"], user=65534, group=65534)  # nobody cannot run our venv
    assert job.pids() == [child.pid]
    assert psutil.Process(child.pid).uids().real == 65534


@needs_cgroupfs
def test_kill_reaches_a_double_forked_setsid_grandchild(box):
    job = box.setup().create("j-fork")
    child = box.python(job, DOUBLE_FORK, stdout=subprocess.PIPE)
    grandchild = int(child.stdout.readline())
    assert os.getsid(grandchild) != os.getsid(child.pid)
    assert {child.pid, grandchild} <= set(job.pids())  # the middle one may still be exiting
    job.kill()
    started = time.monotonic()
    assert asyncio.run(job.wait_empty(5.0))
    assert time.monotonic() - started < 1.0
    assert child.wait(5) == -signal.SIGKILL
    assert _gone(grandchild)
    assert job.pids() == [] and not job.populated()
    job.remove()
    assert not os.path.exists(job.path)
    assert not any(os.path.exists(twin) for twin in job.v1.values())
    job.remove()  # twice is fine


@needs_cgroupfs
def test_signal_reaches_every_process(box):
    job = box.setup().create("j-term")
    children = [box.spawn(job, SLEEP) for _ in range(2)]
    assert job.signal(signal.SIGTERM) == 2
    assert [child.wait(5) for child in children] == [-signal.SIGTERM] * 2
    assert job.signal(signal.SIGTERM) == 0


@needs_cgroupfs
def test_usage(box):
    job = box.setup().create("j-usage")
    burn = (
        "import time\nmemory = b'x' * (150 << 20)\nstart = time.process_time()\n"
        "while time.process_time() - start < 0.25: pass\n"
    )
    assert box.python(job, burn).wait(30) == 0
    usage = job.usage()
    assert usage.cpu_seconds is not None and usage.cpu_seconds >= 0.2
    if "memory" in job.v1 or os.path.exists(f"{job.path}/memory.peak"):
        assert usage.memory_peak is not None and usage.memory_peak >= 100 << 20
    assert usage.oom_kills is None or usage.oom_kills == 0
    assert Usage.from_json(usage.to_json()) == usage


@needs_cgroupfs
def test_a_memory_limit_kills_and_counts(box):
    """JobLimits.memory: past it the kernel's OOM killer ends the job's process, and the
    cgroup counts the kill (what the daemon reports as out of memory)."""
    cgroups = box.setup()
    if "memory" not in cgroups.controls:
        pytest.skip(f"no memory controller for job cgroups here: {cgroups.lacking.get('memory')}")
    job = cgroups.create("j-oom", JobLimits(memory=64 << 20))
    assert box.python(job, "memory = b'x' * (300 << 20)").wait(30) == -signal.SIGKILL
    assert job.usage().oom_kills == 1
    if cgroups.controls["memory"] == V2:
        assert Path(job.path, "memory.oom.group").read_text().strip() == "1"


@needs_cgroupfs
def test_a_pids_limit_stops_a_fork_bomb(box):
    """JobLimits.pids: forks past it fail with EAGAIN in the job; kill takes every process."""
    cgroups = box.setup()
    if "pids" not in cgroups.controls:
        pytest.skip(f"no pids controller for job cgroups here: {cgroups.lacking.get('pids')}")
    job = cgroups.create("j-forks", JobLimits(pids=16))
    child = box.python(job, FORK_BOMB, stdout=subprocess.PIPE, text=True)
    forked, failed = child.stdout.readline().split()
    assert int(forked) < 16 and failed == "EAGAIN"  # 15 children and the forker: the limit
    assert 1 < len(job.pids()) <= 16
    job.kill()
    assert asyncio.run(job.wait_empty(10.0))
    assert child.wait(5) == -signal.SIGKILL and job.pids() == []


@needs_cgroupfs
def test_a_reused_cgroup_keeps_no_earlier_limits(box):
    cgroups = box.setup()
    if not cgroups.controls:
        pytest.skip("neither memory nor pids controller for job cgroups here")
    job = cgroups.create("j-again", JobLimits(pids=32, memory=64 << 20))
    again = cgroups.create("j-again")  # empty: reused, with no limits
    for path, value, _ in limit_writes(again.path, cgroups.enabled, again.v1, JobLimits()):
        if os.path.exists(path):
            written = Path(path).read_text().strip()
            assert written == value or (value == "-1" and int(written) > 1 << 60), path
    assert job.path == again.path


@needs_cgroupfs
def test_kill_without_cgroup_kill(box, monkeypatch):
    """Kernels before 5.14 have no cgroup.kill: SIGKILL by pid, round after round."""
    job = box.setup().create("j-old")
    child = box.python(job, DOUBLE_FORK, stdout=subprocess.PIPE)
    grandchild = int(child.stdout.readline())
    exists = os.path.exists
    monkeypatch.setattr(
        os.path, "exists", lambda path: not path.endswith("cgroup.kill") and exists(path)
    )
    job.kill()
    assert asyncio.run(job.wait_empty(5.0))
    assert child.wait(5) == -signal.SIGKILL and _gone(grandchild)


@needs_cgroupfs
def test_cgroups_a_job_made_inside_its_own(box):
    job = box.setup().create("j-nest")
    inner = f"{job.path}/inner"
    os.mkdir(inner)
    child = box.spawn(_Directory(inner), SLEEP)
    assert job.pids() == [child.pid] and job.populated()
    job.kill()
    assert asyncio.run(job.wait_empty(5.0))
    job.remove()
    assert not os.path.exists(job.path)


@needs_cgroupfs
def test_wait_empty_times_out_without_busy_waiting(box):
    job = box.setup().create("j-wait")
    box.spawn(job, SLEEP)
    cpu, wall = time.process_time(), time.monotonic()
    assert asyncio.run(job.wait_empty(0.3)) is False
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    assert wall >= 0.3
    assert cpu < 0.1, f"{cpu:.3f} s of CPU in {wall:.3f} s: wait_empty busy-waits"


@needs_cgroupfs
def test_wait_empty_wakes_when_the_last_process_exits(box):
    job = box.setup().create("j-exit")
    child = box.python(job, "import time; time.sleep(0.2)")
    started = time.monotonic()
    assert asyncio.run(job.wait_empty(10.0))
    assert time.monotonic() - started < 2.0
    assert child.wait(5) == 0  # the kernel saw it leave before we reaped it


@needs_cgroupfs
def test_reap_leftovers_of_a_previous_run(box):
    first = box.setup()
    job = first.create("j-left")
    child = box.spawn(job, SLEEP)
    second = box.setup()  # the daemon restarted on the same node
    assert second.base == first.base
    assert second.reap_leftovers() == 1
    assert child.wait(5) == -signal.SIGKILL
    assert not os.path.exists(job.path)
    assert not any(os.path.exists(twin) for twin in job.v1.values())
    assert second.reap_leftovers() == 0


@needs_cgroupfs
def test_close_removes_the_subtree(box):
    cgroups = box.setup()
    cgroups.create("j-1").remove()
    cgroups.close()
    assert not os.path.exists(cgroups.base)
    assert not any(os.path.exists(base) for base in cgroups.v1_bases.values())


@needs_cgroupfs
def test_an_explicit_path(box):
    """Made with its parents when missing; close removes what it made, and only that."""
    mount = _real_hierarchy().v2_mount
    cgroups = box.setup(f"/{box.node}/jobs")
    assert cgroups.base == f"{mount}/{box.node}/jobs", cgroups.reason
    cgroups.create("j-1").remove()
    cgroups.close()
    assert not os.path.exists(f"{mount}/{box.node}")
    os.mkdir(f"{mount}/{box.node}")
    try:
        box.setup(f"/{box.node}").close()
        assert os.path.isdir(f"{mount}/{box.node}")  # the administrator's: kept
    finally:
        os.rmdir(f"{mount}/{box.node}")


@needs_cgroupfs
def test_create_checks_the_job_id_and_leftovers(box):
    cgroups = box.setup()
    for bad in ("", "a/b", "../../x", "j 1", "j\n1", "jé"):
        with pytest.raises(ValueError):
            cgroups.create(bad)
    job = cgroups.create("j-again")
    assert cgroups.create("j-again").path == job.path  # empty: reused
    box.spawn(job, SLEEP)
    with pytest.raises(FileExistsError):
        cgroups.create("j-again")


@needs_cgroupfs
def test_a_delegated_systemd_unit(box):
    """A child that looks like a service started by systemd (INVOCATION_ID, a cgroup named
    *.service with trusted.delegate=1) takes its unit as the base and moves into a leaf."""
    hierarchy = _real_hierarchy()
    unit_cgroup = f"{hierarchy.own.rstrip('/')}/{box.node}.service"
    unit = hierarchy.v2_dir(unit_cgroup)
    os.mkdir(unit)
    try:
        os.setxattr(unit, "trusted.delegate", b"1")
        code = (
            "import json, os\nfrom elasticd.shell.cgroups import JobCgroups\n"
            "cgroups = JobCgroups.setup('n1', environ={'INVOCATION_ID': 'x'})\n"
            "job = cgroups.create('j-1')\n"
            "print(json.dumps([cgroups.base, cgroups.reason, job.path, open('/proc/self/cgroup').read()]))\n"
            "job.remove()\ncgroups.close()\n"
        )
        pythonpath = os.pathsep.join(sys.path)
        child = box.spawn(
            _Directory(unit),
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": pythonpath, "INVOCATION_ID": "x"},
        )
        out, _ = child.communicate(timeout=30)
        base, reason, job_path, own = json.loads(out)
        assert (base, reason, job_path) == (unit, "", f"{unit}/job-j-1")
        assert f"0::{unit_cgroup}/daemon" in own.splitlines()
        assert not os.path.exists(job_path)
        assert sorted(name for name in os.listdir(unit) if "." not in name) == ["daemon"]
    finally:
        leftover = JobCgroup(unit)
        leftover.kill()
        asyncio.run(leftover.wait_empty(5.0))
        leftover.remove()


class _Directory:
    """Any cgroup directory, to put a child in with Box.spawn."""

    def __init__(self, path: str) -> None:
        self.path = path

    def join_fds(self) -> list[int]:
        return [os.open(f"{self.path}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)]


def test_cpu_weight_is_set_only_where_the_cpu_controller_is(tmp_path):
    with_cpu, without = tmp_path / "with", tmp_path / "without"
    with_cpu.mkdir()
    without.mkdir()
    (with_cpu / "cpu.weight").write_text("")  # cgroupfs: one write(2) replaces the value
    JobCgroup(str(with_cpu)).set_cpu_weight(1)
    JobCgroup(str(without)).set_cpu_weight(1)
    assert (with_cpu / "cpu.weight").read_text() == "1"
    assert not (without / "cpu.weight").exists()
