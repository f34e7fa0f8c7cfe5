"""Job cgroups: the placement decision table by table, then the real cgroupfs (as root).

The real tests make their cgroups under a node name of their own and remove them, so they
can run next to a daemon and next to each other.
"""

import asyncio
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

from elasticd.cgroups import (Hierarchy, JobCgroup, JobCgroups, Usage, choose_placement,
                              find_hierarchy, home_cgroup)

HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
PURE_V2_MOUNTINFO = "30 23 0:27 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
NO_CGROUP_MOUNTINFO = "22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
BIND_MOUNTINFO = "41 31 0:38 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
SPACE_MOUNTINFO = r"41 31 0:38 / /mnt/my\040cgroups rw - cgroup2 cgroup2 rw" + "\n"

SERVICE = "0::/system.slice/elasticd.service\n"
HYBRID_SELF = "9:name=systemd:/\n4:memory:/process_api/af62\n0::/\n"
SYSTEMD = {"INVOCATION_ID": "0123"}


@pytest.mark.parametrize("mountinfo, proc_cgroup, expected", [
    (HYBRID_MOUNTINFO, HYBRID_SELF,
     Hierarchy("/sys/fs/cgroup/unified", "/", "/", "/sys/fs/cgroup/memory/process_api/af62")),
    (PURE_V2_MOUNTINFO, SERVICE, Hierarchy("/sys/fs/cgroup", "/", "/system.slice/elasticd.service")),
    (NO_CGROUP_MOUNTINFO, "0::/\n", Hierarchy(None, "/", "/")),
    (BIND_MOUNTINFO, "0::/kubepods/pod1/c1\n", Hierarchy("/sys/fs/cgroup", "/kubepods/pod1", "/kubepods/pod1/c1")),
    (SPACE_MOUNTINFO, "0::/\n", Hierarchy("/mnt/my cgroups", "/", "/")),
    ("", "", Hierarchy()),
])
def test_find_hierarchy(mountinfo, proc_cgroup, expected):
    assert find_hierarchy(mountinfo, proc_cgroup) == expected


@pytest.mark.parametrize("hierarchy, cgroup, directory", [
    (Hierarchy("/sys/fs/cgroup", "/", "/"), "/", "/sys/fs/cgroup"),
    (Hierarchy("/sys/fs/cgroup", "/", "/"), "/a/b", "/sys/fs/cgroup/a/b"),
    (Hierarchy("/sys/fs/cgroup", "/kubepods/pod1", "/"), "/kubepods/pod1/c1", "/sys/fs/cgroup/c1"),
    (Hierarchy("/sys/fs/cgroup", "/kubepods/pod1", "/"), "/kubepods/pod1", "/sys/fs/cgroup"),
    (Hierarchy("/sys/fs/cgroup", "/kubepods/pod1", "/"), "/kubepods/pod10", None),
    (Hierarchy(None, "/", "/"), "/", None),
])
def test_v2_dir(hierarchy, cgroup, directory):
    assert hierarchy.v2_dir(cgroup) == directory


HYBRID = find_hierarchy(HYBRID_MOUNTINFO, HYBRID_SELF)
UNDER_SYSTEMD = find_hierarchy(PURE_V2_MOUNTINFO, SERVICE)
MOVED_TO_LEAF = find_hierarchy(PURE_V2_MOUNTINFO, "0::/system.slice/elasticd.service/daemon\n")
IN_A_SCOPE = find_hierarchy(PURE_V2_MOUNTINFO, "0::/user.slice/user-0.slice/session-3.scope\n")
NOT_VISIBLE = find_hierarchy(BIND_MOUNTINFO, "0::/other\n")
UNIT = "/sys/fs/cgroup/system.slice/elasticd.service"


@pytest.mark.parametrize("hierarchy, setting, environ, delegated, writable, base, text", [
    (HYBRID, "off", {}, True, True, None, "disabled by jobs.cgroup = off"),
    (find_hierarchy(NO_CGROUP_MOUNTINFO, "0::/\n"), "auto", {}, True, True, None, "no cgroup2 mount"),
    (HYBRID, "auto", {}, False, True, "/sys/fs/cgroup/unified/elasticd-n1", ""),
    (HYBRID, "auto", {}, False, False, None, "/sys/fs/cgroup/unified is not writable"),
    (UNDER_SYSTEMD, "auto", SYSTEMD, True, True, UNIT, ""),
    (UNDER_SYSTEMD, "auto", SYSTEMD, False, True, None, "set Delegate=yes"),
    (MOVED_TO_LEAF, "auto", SYSTEMD, True, True, UNIT, ""),
    # the same cgroups, not started by systemd (INVOCATION_ID unset): a subtree of our own
    (UNDER_SYSTEMD, "auto", {}, False, True, f"{UNIT}/elasticd-n1", ""),
    # a login session is no service: no delegation needed, our cgroup must be writable
    (IN_A_SCOPE, "auto", SYSTEMD, False, True,
     "/sys/fs/cgroup/user.slice/user-0.slice/session-3.scope/elasticd-n1", ""),
    (NOT_VISIBLE, "auto", {}, True, True, None, "is not visible under the cgroup2 mount"),
    (UNDER_SYSTEMD, "/elasticd", SYSTEMD, False, False, "/sys/fs/cgroup/elasticd", ""),
    (HYBRID, "/jobs/elasticd/", {}, False, False, "/sys/fs/cgroup/unified/jobs/elasticd", ""),
    (HYBRID, "elasticd", {}, True, True, None, "must be 'auto', 'off' or an absolute cgroup path"),
    (HYBRID, "/a/../../etc", {}, True, True, None, "must be 'auto', 'off' or an absolute"),
])
def test_choose_placement(hierarchy, setting, environ, delegated, writable, base, text):
    placement = choose_placement(hierarchy, setting, "n1", environ, delegated=delegated,
                                 writable=writable)
    assert placement.base == base
    assert text in placement.reason
    assert bool(placement.reason) is (base is None)
    assert placement.systemd is (base == UNIT)


def test_placement_details():
    assert choose_placement(HYBRID, "auto", "n1", {}, delegated=False, writable=True).v1_base \
        == "/sys/fs/cgroup/memory/process_api/af62/elasticd-n1"
    assert choose_placement(UNDER_SYSTEMD, "auto", "n1", SYSTEMD, delegated=True,
                            writable=True).v1_base is None  # pure v2: no v1 memory tree
    assert "cannot name a cgroup" in choose_placement(HYBRID, "auto", "a/b", {}, delegated=True,
                                                       writable=True).reason
    assert home_cgroup(MOVED_TO_LEAF, SYSTEMD) == ("/system.slice/elasticd.service", True)
    assert home_cgroup(MOVED_TO_LEAF, {}) == ("/system.slice/elasticd.service/daemon", False)


@pytest.mark.parametrize("usage", [Usage(), Usage(1.5, 2 << 30, 0), Usage(cpu_seconds=0.25)])
def test_usage_round_trip(usage):
    assert Usage.from_json(json.loads(json.dumps(usage.to_json()))) == usage


@pytest.mark.parametrize("doc, usage", [
    ({}, Usage()), (None, Usage()), ([], Usage()),
    ({"cpu_seconds": 3, "memory_peak": 1.0e9, "extra": 1}, Usage(3.0, 1_000_000_000)),
    ({"cpu_seconds": "3", "memory_peak": True, "oom_kills": 2}, Usage(oom_kills=2)),
    ({"cpu_seconds": float("nan"), "memory_peak": float("inf")}, Usage()),
])
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


# --- the real cgroupfs ---

def _real_hierarchy() -> Hierarchy:
    with open("/proc/self/mountinfo") as mountinfo, open("/proc/self/cgroup") as own:
        return find_hierarchy(mountinfo.read(), own.read())


_NO_CGROUPFS = os.geteuid() != 0 or _real_hierarchy().v2_mount is None


def needs_cgroupfs(test):
    skip = pytest.mark.skipif(_NO_CGROUPFS, reason="needs root and a cgroup2 mount: the test "
                                                   "makes real cgroups")
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
            child = subprocess.Popen(argv, preexec_fn=lambda: [os.write(fd, b"0") for fd in fds],
                                     **kwargs)
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
    if job.v1_path:
        assert open(f"{job.v1_path}/cgroup.procs").read().split() == [str(child.pid)]


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
    assert job.v1_path is None or not os.path.exists(job.v1_path)
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
    burn = ("import time\nmemory = b'x' * (150 << 20)\nstart = time.process_time()\n"
            "while time.process_time() - start < 0.25: pass\n")
    assert box.python(job, burn).wait(30) == 0
    usage = job.usage()
    assert usage.cpu_seconds is not None and usage.cpu_seconds >= 0.2
    if job.v1_path or os.path.exists(f"{job.path}/memory.peak"):
        assert usage.memory_peak is not None and usage.memory_peak >= 100 << 20
    assert usage.oom_kills is None or usage.oom_kills == 0
    assert Usage.from_json(usage.to_json()) == usage


@needs_cgroupfs
def test_oom_kills_are_counted(box):
    job = box.setup().create("j-oom")
    if job.v1_path:
        Path(job.v1_path, "memory.limit_in_bytes").write_text(str(64 << 20))
    elif os.path.exists(f"{job.path}/memory.max"):
        Path(job.path, "memory.max").write_text(str(64 << 20))
        Path(job.path, "memory.swap.max").write_text("0")
    else:
        pytest.skip("no memory controller for job cgroups here")
    assert box.python(job, "memory = b'x' * (300 << 20)").wait(30) == -signal.SIGKILL
    assert job.usage().oom_kills == 1


@needs_cgroupfs
def test_kill_without_cgroup_kill(box, monkeypatch):
    """Kernels before 5.14 have no cgroup.kill: SIGKILL by pid, round after round."""
    job = box.setup().create("j-old")
    child = box.python(job, DOUBLE_FORK, stdout=subprocess.PIPE)
    grandchild = int(child.stdout.readline())
    exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda path: not path.endswith("cgroup.kill") and exists(path))
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
    assert job.v1_path is None or not os.path.exists(job.v1_path)
    assert second.reap_leftovers() == 0


@needs_cgroupfs
def test_close_removes_the_subtree(box):
    cgroups = box.setup()
    cgroups.create("j-1").remove()
    cgroups.close()
    assert not os.path.exists(cgroups.base)
    assert cgroups.v1_base is None or not os.path.exists(cgroups.v1_base)


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
        code = ("import json, os\nfrom elasticd.cgroups import JobCgroups\n"
                "cgroups = JobCgroups.setup('n1', environ={'INVOCATION_ID': 'x'})\n"
                "job = cgroups.create('j-1')\n"
                "print(json.dumps([cgroups.base, cgroups.reason, job.path, open('/proc/self/cgroup').read()]))\n"
                "job.remove()\ncgroups.close()\n")
        pythonpath = os.pathsep.join(sys.path)
        child = box.spawn(_Directory(unit), [sys.executable, "-c", code], stdout=subprocess.PIPE,
                          env={**os.environ, "PYTHONPATH": pythonpath, "INVOCATION_ID": "x"})
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
