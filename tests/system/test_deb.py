"""The Debian package on three hosts under real systemd (docs/operations.md).

``packaging/build-deb`` builds the package from this checkout.  Three hosts n1..n3 are
``systemd-nspawn`` containers (sdbox.py) on one private network (netns.py: 10.77.X.1..3),
each booting a root of its own: an overlay whose lower layer is this machine's root
filesystem (so a fresh host of this machine's Debian, without elasticd) and whose upper
layer is the host's "disk", kept while the host is powered off and booted again.  Nothing
reaches the host's own root.

What is checked, in order (the timeline is printed at the end of the run):
1. ``dpkg -i`` offline on every host: the unit is enabled and started (``--standalone``,
   from /etc/default/elasticd), the ``elasticd-admin`` group exists, /usr/bin/python3 has no
   torch and the daemon runs anyway.
2. The cluster: every host's /etc/elasticd/elasticd.toml names the store on n1, whose
   /etc/default/elasticd points ELASTICD_PYTHON at a venv with torch (this machine's
   torch 2.13.0 CPU wheel in a venv of /usr/bin/python3, mounted at /opt/torch: "the node's
   torch install", which the jobs use too): its daemon runs that Python and still never
   loads torch (it serves TCPStore's protocol itself); n2 and n3 run Debian's python3.
   n1 makes the cluster key (0600) at its first start as store host and keeps it across
   restarts; it is copied to n2 and n3.
3. A job (examples/ddp_train.py, gloo, one worker per node, submitted by ``nobody``) runs on
   3 nodes; n3 loses power (SIGKILL to every process of the container); the job re-forms on
   two; n3 boots again, its elasticd starts with the machine and the job grows back to 3.
4. A job on n2 and n3; ``systemctl stop elasticd`` on n1, the store host: n2 reports the
   store unreachable and both keep their workers (same PIDs); ``systemctl start`` on n1:
   reachable again, the same workers.
5. ``journalctl -u elasticd`` on n2 has the daemon's lines with their priorities and fields.
6. ``dpkg -r`` on n3 stops the service and leaves no process, keeps config and state;
   ``dpkg -P`` removes configuration, key and state.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import netns
import pytest
import sdbox
from harness import ROOT, WORKER
from hostwide import made_once
from store_attack import wait_for

# one xdist worker runs both tests: the Debian 13 image is made in a thread beside the
# three-host test (the module's fixtures), and both build the package
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.xdist_group("deb")]

TORCH_VENV = Path("/var/tmp/elasticd-test-torch-2.13.0")  # 1 GB, 30 s to make: kept between runs
# the job's scripts, mounted at the same place on every host (the checkout may be under
# /tmp, which each host's systemd mounts anew)
JOBS = "/opt/elasticd-test"
TRAIN = f"{JOBS}/examples/ddp_train.py"
WORKER_SCRIPT = f"{JOBS}/fixtures/worker.py"
CLEAN_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")
REPORT: list[str] = []  # the timeline and the transcript's highlights, printed by conftest
STARTED = time.monotonic()


def note(line: str) -> None:
    REPORT.append(f"{time.monotonic() - STARTED:7.1f} s  {line}")


def transcript(done: subprocess.CompletedProcess[str]) -> str:
    """What a command printed, on one line."""
    return " | ".join(
        line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()
    )


def until(what: str, probe: Callable[[], Any], timeout: float = 90.0) -> Any:
    """Re-run ``probe`` until it returns something true.  What these wait for (a unit's
    state, a job's round seen through another daemon) gives no event to block on from
    outside the container, so this is a bounded poll."""
    return wait_for(probe, timeout, what, interval=0.25)


def torch_venv() -> Path:
    """A venv of /usr/bin/python3 with torch 2.13.0 (the local CPU wheel), made once."""

    def make(venv: Path) -> None:
        subprocess.run(["/usr/bin/python3", "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "python3"), "-m", "pip", "install", "-q"]
            + ["torch==2.13.0", "numpy==2.4.6"],
            check=True,
            capture_output=True,
        )

    return made_once(TORCH_VENV, make)


class Host:
    """One machine: an overlay root (its disk) booted by systemd-nspawn in netns host i."""

    def __init__(
        self,
        i: int,
        hosts: netns.Hosts | None,
        work: Path,
        binds_ro: list[str],
        image: Path = Path("/"),
    ) -> None:
        """Host i of ``hosts`` (None: alone, on a private network), booting ``image``."""
        self.i, self.name = i, f"n{i}"
        self.addr = hosts.addr(i) if hosts else "127.0.0.1"
        self.netns = hosts.ns(i) if hosts else None
        self.work, self.binds_ro = work, binds_ro
        disk = work / self.name
        self.root = disk / "root"
        for part in ("upper", "work", "root"):
            (disk / part).mkdir(parents=True)
        subprocess.run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir={image},upperdir={disk / 'upper'},workdir={disk / 'work'}",
                str(self.root),
            ],
            check=True,
        )
        self.box: sdbox.Box | None = None

    def boot(self, wait: bool = True) -> Host:
        """Power on; unless told not to, wait until its systemd has started up (else
        ``booted``: hosts boot together)."""
        tag = hashlib.sha256(str(self.work).encode()).hexdigest()[:6]  # a valid machine name
        self.box = sdbox.Box(
            f"{self.name}-{tag}",
            self.work,
            root=self.root,
            netns=self.netns,
            binds_ro=self.binds_ro,
        ).start()
        return self.booted() if wait else self

    def booted(self) -> Host:
        assert self.box is not None
        self.box.wait_up()
        return self

    def run(
        self, *argv: str, check: bool = True, user: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        assert self.box is not None
        if user is not None:
            argv = ("runuser", "-u", user, "--", *argv)
        return self.box.run("env", "-i", *CLEAN_ENV, *argv, check=check)

    def file(self, inside: str) -> Path:
        """A file of this host's disk, from outside."""
        return self.root / inside.lstrip("/")

    def ctl(self, *args: str, user: str = "nobody", expect: int = 0) -> Any:
        try:
            done = self.run("elasticctl", "--json", *args, user=user, check=False)
        except subprocess.TimeoutExpired as exc:  # what the daemon was doing meanwhile
            said = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode()
            job = re.search(r'"id": "(j-[0-9a-f]+)"', said)
            stories = self.run(
                "timeout",
                "20",
                "elasticctl",
                "status",
                "--debug",
                job[1] if job else "?",
                check=False,
            )
            raise AssertionError(
                f"{self.name}: elasticctl {' '.join(args)} did not end in {exc.timeout:.0f} s\n"
                f"it said: {said}\nelasticctl status --debug: {stories.stdout}{stories.stderr}\n"
                f"{self.journal()}"
            ) from None
        assert done.returncode == expect, (
            f"{self.name}: elasticctl {' '.join(args)} exited "
            f"{done.returncode}\n{done.stdout}\n{done.stderr}\n"
            f"{self.journal()}"
        )
        docs = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        return docs[-1] if docs else None

    def systemctl(self, *args: str, check: bool = True) -> str:
        return self.run("systemctl", *args, check=check).stdout.strip()

    def unit(self, *props: str) -> dict[str, str]:
        out = self.systemctl("show", "elasticd", *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines())

    def journal(self, *args: str) -> str:
        if self.box is None or not self.box.init_pid:
            return ""
        return self.run("journalctl", "--no-pager", "-u", "elasticd", *args, check=False).stdout

    def power_off(self) -> None:
        assert self.box is not None
        self.box.pull_the_plug()

    def shutdown(self) -> None:
        if self.box is not None:
            self.box.down()
        subprocess.run(["umount", "-l", str(self.root)], check=False)


def build_deb(out: Path, *options: str) -> Path:
    """packaging/build-deb as a release runs it, but for xz's level: 1, not dpkg-deb's 6 (the
    same files in the same format; 6 took 15 s more per build on 2 cores)."""
    done = subprocess.run(
        ["bash", str(ROOT / "packaging" / "build-deb"), *options, str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "DPKG_DEB_COMPRESSOR_LEVEL": "1"},
    )
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    listing = subprocess.run(
        ["dpkg-deb", "--contents", str(path)], capture_output=True, text=True, check=True
    ).stdout
    note(
        f"built {path.name}: {path.stat().st_size / 2**20:.1f} MiB, "
        f"{sum(1 for line in listing.splitlines() if not line.startswith('d'))} files"
    )
    return path


@pytest.fixture(scope="module")
def deb(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    if FRESH in {item.name for item in request.session.items}:
        request.getfixturevalue("debian13_deb")  # made meanwhile, in a thread of its own
    return build_deb(tmp_path_factory.mktemp("deb"))


@pytest.fixture(scope="module")
def debian13_deb(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Future[tuple[Path, Path]] | None]:
    """The Debian 13 image and the package for its Python 3.13 (FRESH's), made in a thread
    from the module's start: they wait on the network and on xz while the three-host test
    waits on its containers.  None where FRESH skips."""
    if sdbox.usable() or shutil.which("debootstrap") is None:
        yield None
        return
    out = tmp_path_factory.mktemp("deb13")
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(lambda: (debian13(), build_deb(out, "--python-version", "3.13")))


@pytest.fixture(scope="module")
def cluster(deb: Path) -> Iterator[list[Host]]:
    for why in (sdbox.usable(), netns.usable()):
        if why:
            pytest.skip(why)
    venv = torch_venv()
    work = Path(tempfile.mkdtemp(prefix="elasticd-deb-", dir="/var/tmp"))  # not /tmp: tmpfiles
    subnet = netns.Subnet.claim()
    hosts = subnet.hosts(3).up()
    binds = [
        f"{deb.parent}:/pkg",
        f"{venv}:/opt/torch",
        f"{ROOT / 'examples'}:{JOBS}/examples",
        f"{WORKER.parent}:{JOBS}/fixtures",
    ]
    machines: list[Host] = []
    try:
        for i in (1, 2, 3):
            machines.append(Host(i, hosts, work, binds))
        etc_hosts = "127.0.0.1 localhost\n" + "".join(f"{m.addr} {m.name}\n" for m in machines)
        for m in machines:
            m.file("/etc/hosts").write_text(etc_hosts)
            m.file("/etc/hostname").write_text(m.name + "\n")
            # this machine's image is a container's, whose policy-rc.d forbids starting any
            # service at install (deb-systemd-invoke honours it); a server has none
            m.file("/usr/sbin/policy-rc.d").unlink(missing_ok=True)
        for m in machines:
            m.boot(wait=False)
        for m in machines:
            m.booted()
        yield machines
    finally:
        for m in machines:
            m.shutdown()
        hosts.down()
        subnet.release()
        shutil.rmtree(work, ignore_errors=True)


def daemon_python(m: Host) -> str:
    """The Python that runs m's daemon (the first word of its command line)."""
    pid = m.unit("MainPID")["MainPID"]
    return m.run("cat", f"/proc/{pid}/cmdline").stdout.split("\0")[0]


def loads_torch(m: Host) -> bool:
    """Whether m's daemon has torch's library mapped."""
    pid = m.unit("MainPID")["MainPID"]
    return "libtorch" in m.run("cat", f"/proc/{pid}/maps").stdout


def cluster_config(m: Host, store: Host) -> str:
    return (
        f'[node]\nname = "{m.name}"\naddress = "{m.addr}"\nslots = 2\n\n'
        f'[cluster]\nname = "three"\n\n'
        f'[store]\nendpoint = "{store.addr}:29400"\n\n'
        "[jobs]\njoin_timeout = 300.0\n\n"
        "[scheduler]\nresize_interval = 1.0\n"
    )  # n3 taken back once it is up, not 30 s after the shrink


def world(host: Host, job: str) -> tuple[int, int, list[str], str]:
    """(round, world size, nodes, state) of a job as ``host`` shows it."""
    doc = host.ctl("status", job)
    return doc["round"], doc["world_size"], sorted(n["node"] for n in doc["nodes"]), doc["state"]


def healthy_pids(host: Host, job: str) -> list[int]:
    doc = host.ctl("status", job)
    return sorted(w["pid"] for w in doc["workers"] if w["state"] == "HEALTHY" and w["pid"])


def test_three_hosts_install_the_package_and_run_elastic_jobs(
    cluster: list[Host], deb: Path
) -> None:
    n1, n2, n3 = cluster

    # 1. install, offline (the hosts have no route out), on every host
    for m in cluster:
        assert m.run("python3", "-c", "import torch", check=False).returncode != 0  # no torch
        done = m.run("dpkg", "-i", f"/pkg/{deb.name}")
        note(f"{m.name}: dpkg -i -> {transcript(done)}")
        assert m.systemctl("is-enabled", "elasticd") == "enabled"
        until(
            f"{m.name}: elasticd active",
            lambda: m.systemctl("is-active", "elasticd", check=False) == "active",
        )
        assert m.run("getent", "group", "elasticd-admin").returncode == 0
        assert "standalone" in m.ctl("version")["elasticd"]["store"]  # its store in memory
    note(
        "installed on n1..n3: unit enabled and active (--standalone), no torch in /usr/bin/python3"
    )

    # 2. the cluster: n1 hosts the store on the venv's Python (ELASTICD_PYTHON), which has
    # torch, and loads none; n2 and n3 join it
    for m in cluster:
        m.file("/etc/elasticd/elasticd.toml").write_text(cluster_config(m, n1))
        extra = "ELASTICD_PYTHON=/opt/torch/bin/python3\n" if m is n1 else ""
        m.file("/etc/default/elasticd").write_text(f'ELASTICD_OPTS=""\n{extra}')
    n1.systemctl("restart", "elasticd")
    key = n1.file("/var/lib/elasticd/cluster.key")
    assert oct(key.stat().st_mode & 0o777) == "0o600" and key.stat().st_uid == 0
    digest = hashlib.sha256(key.read_bytes()).hexdigest()
    for m in (n2, n3):
        target = m.file("/var/lib/elasticd/cluster.key")
        target.write_bytes(key.read_bytes())
        target.chmod(0o600)
        m.systemctl("restart", "elasticd")
    n1.systemctl("restart", "elasticd")  # the key is kept, never made anew
    assert hashlib.sha256(key.read_bytes()).hexdigest() == digest
    until(
        "three nodes up",
        lambda: (
            sorted(n["name"] for n in n2.ctl("nodes") if n["state"] == "up") == ["n1", "n2", "n3"]
        ),
    )
    pythons = [daemon_python(m) for m in (n1, n2)]
    assert "/opt/torch/" in pythons[0] and pythons[1].startswith("/usr/bin/python3"), pythons
    assert not loads_torch(n1), "the store host's daemon loaded torch"
    note("cluster formed: n1 store host on ELASTICD_PYTHON (torch not loaded), key 0600 kept")
    # ... continued in the steps below
    node_loss_and_return(cluster)
    store_host_stop(cluster)
    journal_fields(n2)
    remove_and_purge(n3, deb)


def node_loss_and_return(cluster: list[Host]) -> None:
    _n1, n2, n3 = cluster
    job = n2.ctl(
        "submit",
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "3",
        "--python",
        "/opt/torch/bin/python3",
        TRAIN,
        "--",
        "--epochs",
        "100000",
        "--epoch-seconds",
        "0.2",
    )["id"]
    note(f"{job}: submitted by nobody on n2 (--nnodes 2:3, ddp_train.py with gloo)")
    until(
        f"{job} on 3 nodes", lambda: world(n2, job)[1:] == (3, ["n1", "n2", "n3"], "RUNNING"), 180
    )
    note(f"{job}: running on n1, n2, n3 (round {world(n2, job)[0]})")
    starts = wait_for_training(n2, job, "world size 3", 0)
    note(f"{job}: training at world size 3")
    n3.power_off()
    note("n3: power lost (every process of the container SIGKILLed)")
    until(
        f"{job} re-formed on two", lambda: world(n2, job)[1:] == (2, ["n1", "n2"], "RUNNING"), 120
    )
    note(f"{job}: re-formed on n1, n2 (round {world(n2, job)[0]})")
    starts = wait_for_training(n2, job, "world size 2", starts)
    note(f"{job}: training resumed at world size 2 (an epoch's loss logged)")
    n3.boot()
    note("n3: booted again (elasticd starts with it: the unit is enabled)")
    until(
        f"{job} grown back", lambda: world(n2, job)[1:] == (3, ["n1", "n2", "n3"], "RUNNING"), 180
    )
    note(f"{job}: grown back to n1, n2, n3 (round {world(n2, job)[0]})")
    wait_for_training(n2, job, "world size 3", starts)
    note(f"{job}: training resumed at world size 3")
    assert n2.ctl("status", job)["restarts"] == 0  # losing and regaining a node spent none
    n2.ctl("cancel", job)


def wait_for_training(host: Host, job: str, text: str, starts: int) -> int:
    """Until rank 0 of a new round (more than ``starts`` rounds started so far) printed
    ``text`` (ddp_train.py: "world size N, starting at epoch E (restart count C)") and then
    an epoch's loss; the rounds started so far."""

    def trained() -> int:
        lines = host.run("elasticctl", "logs", job, user="nobody", check=False).stdout.splitlines()
        begun = [i for i, line in enumerate(lines) if "starting at epoch" in line]
        fresh = len(begun) > starts and text in lines[begun[-1]]
        return len(begun) if fresh and any("loss" in line for line in lines[begun[-1] :]) else 0

    return until(f"{job}: a new round's {text!r} and a loss after it", trained, 120)


def store_host_stop(cluster: list[Host]) -> None:
    n1, n2, n3 = cluster
    job = n2.ctl(
        "submit",
        "--nnodes",
        "2",
        "--nodes",
        "n2,n3",
        "--nproc-per-node",
        "1",
        "--python",
        "/opt/torch/bin/python3",
        WORKER_SCRIPT,
        "--",
        "--sleep",
        "0",
    )["id"]
    pids = until(
        f"{job} running",
        lambda: (
            world(n2, job)[1:] == (2, ["n2", "n3"], "RUNNING")
            and len(healthy_pids(n2, job)) == 2
            and healthy_pids(n2, job)
        ),
        120,
    )
    note(f"{job}: running on n2, n3; systemctl stop elasticd on n1 (the store host)")
    n1.systemctl("stop", "elasticd")
    for m in (n2, n3):
        until(
            f"{m.name} reports the store down",
            lambda: not m.ctl("version")["elasticd"]["store_up"],
            60,
        )
        until(
            f"{m.name}: STATUS= says unreachable",
            lambda: "unreachable" in m.unit("StatusText")["StatusText"],
            60,
        )
    note("n2, n3: store reported unreachable (elasticctl version, systemd StatusText)")
    assert world(n2, job)[3] == "RUNNING" and healthy_pids(n2, job) == pids
    for m in (n2, n3):
        for pid in (w["pid"] for w in m.ctl("status", job)["workers"] if w["node"] == m.name):
            assert m.run("kill", "-0", str(pid), check=False).returncode == 0  # still alive
    n1.systemctl("start", "elasticd")
    note("n1: systemctl start elasticd")
    for m in (n2, n3):
        until(
            f"{m.name} reaches the store again",
            lambda: m.ctl("version")["elasticd"]["store_up"],
            90,
        )
    until(
        f"{job} seen again through n1",
        lambda: world(n1, job)[1:] == (2, ["n2", "n3"], "RUNNING"),
        60,
    )
    # the same workers: nothing was restarted.  Waited for, not read once: each node
    # republishes its parts into the new store on its own duty, so for a moment a node can
    # show the job before it has read the workers' states again.
    try:
        until(f"{job}: the same workers {pids} healthy", lambda: healthy_pids(n2, job) == pids, 60)
    except AssertionError as exc:  # what n2 shows instead, and why
        raise AssertionError(
            f"{exc}\nn2: elasticctl status: {json.dumps(n2.ctl('status', job), indent=1)}\n"
            f"{n2.journal()}\n{n1.journal()}"
        ) from None
    note(f"{job}: store reachable again from n2, n3; the same workers (no restart)")
    n2.ctl("cancel", job)


def journal_fields(host: Host) -> None:
    records = [json.loads(line) for line in host.journal("-o", "json").splitlines() if line.strip()]
    priorities = {r.get("PRIORITY") for r in records}
    assert {"4", "6"} <= priorities, priorities  # warnings (the store lost) and information
    assert any(r.get("ELASTICD_NODE") == host.name for r in records)
    assert any(r.get("ELASTICD_JOB", "").startswith("j-") for r in records)
    shown = host.journal("-p", "warning", "-o", "cat")
    assert "store" in shown, shown
    note(
        f"{host.name}: journalctl -u elasticd: {len(records)} records, priorities "
        f"{sorted(priorities)}, fields ELASTICD_NODE and ELASTICD_JOB"
    )


def remove_and_purge(host: Host, deb: Path) -> None:
    done = host.run("dpkg", "-r", "elasticd")
    note(f"{host.name}: dpkg -r -> {transcript(done)}")
    assert host.unit("ActiveState", "LoadState")["ActiveState"] in ("inactive", "failed")
    left = host.run("pgrep", "-a", "-f", "elasticd", check=False).stdout.strip()
    assert not left, f"processes left after dpkg -r: {left}"
    assert host.file("/etc/elasticd/elasticd.toml").exists()  # a conffile stays until purge
    assert host.file("/var/lib/elasticd/cluster.key").exists()
    done = host.run("dpkg", "-P", "elasticd")
    note(f"{host.name}: dpkg -P -> {transcript(done)}")
    for gone in (
        "/etc/elasticd",
        "/var/lib/elasticd",
        "/etc/default/elasticd",
        "/usr/bin/elasticd",
        "/usr/lib/elasticd",
    ):
        assert not host.file(gone).exists(), f"{gone} left after purge"


TRIXIE = Path("/var/tmp/elasticd-test-debian13")  # debootstrap's, kept between runs (40 s)
FRESH = "test_a_fresh_debian_13_host_installs_runs_removes_and_purges"


def debian13() -> Path:
    """A minimal Debian 13 with systemd and python3 (what a fresh server has), made once."""

    def make(root: Path) -> None:
        done = subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=systemd,systemd-sysv,dbus,python3",
                "trixie",
                str(root),
                "http://deb.debian.org/debian",
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, (
            f"debootstrap failed\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )

    return made_once(TRIXIE, make)


def test_a_fresh_debian_13_host_installs_runs_removes_and_purges(
    debian13_deb: Future[tuple[Path, Path]] | None,
) -> None:
    """Offline (no network in the container) on a fresh Debian 13: dpkg -i, the unit
    active (standalone, no torch anywhere), a job of `nobody` succeeds, dpkg -r leaves no
    process, dpkg -P leaves no configuration, key or state."""
    if sdbox.usable():
        pytest.skip(sdbox.usable())
    if shutil.which("debootstrap") is None:
        pytest.skip("needs debootstrap; see .ci/setup-root.sh")
    assert debian13_deb is not None
    image, deb = debian13_deb.result()
    work = Path(tempfile.mkdtemp(prefix="elasticd-deb13-", dir="/var/tmp"))
    host = Host(1, None, work, [f"{deb.parent}:/pkg"], image=image)
    try:
        host.file("/opt/hello.py").write_text(
            "import os\nprint('hello from rank', os.environ['RANK'])\n"
        )
        host.boot()
        assert "Debian GNU/Linux 13" in host.file("/etc/os-release").read_text()
        done = host.run("dpkg", "-i", f"/pkg/{deb.name}")
        note(f"debian 13: dpkg -i -> {transcript(done)}")
        until(
            "elasticd active",
            lambda: host.systemctl("is-active", "elasticd", check=False) == "active",
        )
        assert host.systemctl("is-enabled", "elasticd") == "enabled"
        job = host.ctl("submit", "--nproc-per-node", "2", "--wait", "/opt/hello.py")
        assert job["state"] == "SUCCEEDED", job
        logs = host.run("elasticctl", "logs", job["id"], user="nobody").stdout
        assert "hello from rank 1" in logs, logs
        note("debian 13: unit active (standalone, no torch), a job of nobody SUCCEEDED")
        refuses_a_python_others_can_change(host)
        note(f"debian 13: dpkg -r -> {transcript(host.run('dpkg', '-r', 'elasticd'))}")
        left = host.run("pgrep", "-a", "-f", "elasticd", check=False).stdout.strip()
        assert not left, f"processes left after dpkg -r: {left}"
        assert host.file("/var/lib/elasticd").exists()
        note(f"debian 13: dpkg -P -> {transcript(host.run('dpkg', '-P', 'elasticd'))}")
        for gone in (
            "/etc/elasticd",
            "/var/lib/elasticd",
            "/etc/default/elasticd",
            "/usr/lib/elasticd",
        ):
            assert not host.file(gone).exists(), f"{gone} left after purge"
        note("debian 13: dpkg -r left no process; dpkg -P removed configuration and state")
    finally:
        host.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def refuses_a_python_others_can_change(host: Host) -> None:
    """ELASTICD_PYTHON naming a venv that a user can write to: the daemon (root) would run
    that user's code; the launcher refuses to start, and says why."""
    venv = host.file("/opt/loose")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python3").symlink_to("/usr/bin/python3")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / "lib").mkdir()
    (venv / "lib" / "planted.pth").write_text("")
    (venv / "lib" / "planted.pth").chmod(0o666)
    default = host.file("/etc/default/elasticd")
    kept = default.read_text()
    default.write_text(kept + "ELASTICD_PYTHON=/opt/loose/bin/python3\n")
    assert host.run("systemctl", "restart", "elasticd", check=False).returncode != 0
    assert "/opt/loose/lib/planted.pth is writable by everyone" in host.journal(), host.journal()
    default.write_text(kept)
    host.systemctl("restart", "elasticd")
    note("debian 13: ELASTICD_PYTHON in a venv others can write to: refused, with the reason")
