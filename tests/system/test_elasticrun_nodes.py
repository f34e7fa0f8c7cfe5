"""A multi-node torchrun line run once per node where no elasticd is installed
(docs/elasticrun.md, "Where no elasticd runs"): each host's elasticrun starts a private
daemon for the job, as a user who is not root, and those daemons form the job's cluster.

Three (or four) network-namespace test hosts (netns.py), a user made for the test, no
daemon: the same line given to torchrun and to elasticrun ends with the same parameters;
a host's elasticrun SIGKILLed mid-training leaves the others going (torchrun on the same
line: what it did is printed beside) and a new elasticrun joins; Ctrl-C on one host cancels
the job everywhere and leaves nothing; losing the store's host ends the job everywhere with
the reason (c10d), and on etcd no host is special.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import netns
import pytest
from harness import wait_gone
from user_nodes import (
    ELASTICRUN,
    TORCHRUN,
    TRAIN,
    Account,
    Launch,
    host_name,
    host_names,
    job_directories,
    left_behind,
    user_made,
)

from elasticd.wire import paths

pytestmark = [pytest.mark.root, pytest.mark.slow]

STORE_PORT = 29400  # a fresh network stack on every test host: nothing holds it
REPORT: list[str] = []  # torchrun beside elasticrun, printed at the end of the run
WORLD = r"^start rank (\d+) world {world} "


@pytest.fixture(scope="module")
def subnet() -> Iterator[netns.Subnet]:
    why = netns.usable()
    if why:
        pytest.skip(why)
    claimed = netns.Subnet.claim()
    yield claimed
    claimed.release()


@pytest.fixture
def user(shared_tmp: Path) -> Iterator[Account]:
    with user_made(shared_tmp) as account:
        yield account


@pytest.fixture
def hosts(subnet: netns.Subnet, request: pytest.FixtureRequest) -> Callable[[int], netns.Hosts]:
    def make(count: int) -> netns.Hosts:
        made = subnet.hosts(count)
        request.addfinalizer(made.down)  # last: kills what is left there, by pid
        made.up()
        request.addfinalizer(host_names(made))
        return made

    return make


def env_of(user: Account, **extra: str) -> dict[str, str]:
    """The user's environment; gloo binds to eth0 (the host name is 127.0.0.1 in every
    namespace); elasticrun goes private without being told unless a daemon answers here."""
    env = user.env(GLOO_SOCKET_IFNAME="eth0", **extra)
    if _answers(paths.default_socket_path()):  # a system daemon of another test run
        env["PET_PRIVATE"] = "1"
    return env


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect(path)
        except OSError:
            return False
    return True


def line(
    hosts: netns.Hosts, nnodes: str, run_id: str, *script: str, extra: tuple = ()
) -> list[str]:
    return [
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{hosts.addr(1)}:{STORE_PORT}",
        "--rdzv-id",
        run_id,
        *extra,
        str(TRAIN),
        *script,
    ]


def launch_all(
    hosts: netns.Hosts,
    user: Account,
    launcher: tuple[str, ...],
    argv: list[str],
    env: dict,
    count: int,
) -> list[Launch]:
    return [Launch(hosts, i, user, [*launcher, *argv], env) for i in range(1, count + 1)]


def node_name(launch: Launch) -> str:
    """The node name elasticrun gives its private daemon (host name and its pid)."""
    return f"{host_name(launch.index)}-{launch.proc.pid}"


def key_file(user: Account) -> Path:
    """A job key in the user's home, 0600, as a user makes one for a job."""
    path = user.home / "job.key"
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    os.chown(path, user.uid, user.gid)
    return path


def checksum(launches: list[Launch]) -> str:
    found = {m.group(1) for m in (_checksum(launch) for launch in launches) if m}
    assert len(found) == 1, [launch.text() for launch in launches]
    return found.pop()


def _checksum(launch: Launch):
    return re.search(r"^checksum ([0-9a-f]{64})$", launch.text(), re.M)


def test_the_same_line_ends_with_the_same_parameters_under_torchrun_and_elasticrun(hosts, user):
    hosts = hosts(3)
    env = env_of(user)
    tag = uuid.uuid4().hex[:8]
    runs = {}
    for name, launcher in (("torchrun", TORCHRUN), ("elasticrun", ELASTICRUN)):
        argv = line(hosts, "3", f"sum-{name}-{tag}", "--steps", "12")
        launches = launch_all(hosts, user, launcher, argv, env, 3)
        codes = [launch.wait(240) for launch in launches]
        assert codes == [0, 0, 0], [launch.story("exit") for launch in launches]
        for launch in launches:
            launch.wait_line(WORLD.format(world=3), timeout=1)
        runs[name] = checksum(launches)
        if name == "elasticrun":
            warned = launches[0].wait_line(r"warning: no key for this job", "err", timeout=1)
            assert warned, "a job without a key says so"
            assert left_behind(user, [node_name(launch) for launch in launches], hosts) == []
    REPORT.append(f"same line, 3 nodes x 1 worker, 12 steps: checksums {runs}")
    assert runs["torchrun"] == runs["elasticrun"]


def test_a_killed_node_leaves_the_others_going_and_a_new_one_joins(hosts, user):
    hosts = hosts(3)
    key = key_file(user)
    env = env_of(user)
    tag = uuid.uuid4().hex[:8]
    script = ("--steps", "40", "--step-seconds", "0.25")
    hold = user.home / f"hold-{tag}"  # no step until the newcomer is in: the job cannot end first
    hold.touch()
    argv = line(
        hosts,
        "2:3",
        f"kill-{tag}",
        *script,
        "--hold",
        str(hold),
        extra=("--rdzv-conf", f"key_file={key}"),
    )
    nodes = launch_all(hosts, user, ELASTICRUN, argv, env, 3)
    for node in nodes:
        node.wait_line(WORLD.format(world=3), timeout=240)
    victim = nodes[2]  # not the store's host
    names = [node_name(node) for node in nodes]
    its = [proc.pid for proc in victim.descendants()]  # its private daemon and its worker
    assert its, "the private daemon and its worker run under elasticrun"
    victim.signal(signal.SIGKILL)
    killed = time.monotonic()
    assert victim.wait(30) == -signal.SIGKILL
    for node in nodes[:2]:
        node.wait_line(WORLD.format(world=2), timeout=120)
    reformed = time.monotonic() - killed
    # the killed elasticrun's daemon stopped its worker and itself, and removed its directory
    assert wait_gone(its, timeout=60) == []
    assert victim.proc.pid not in job_directories(user)
    marks = [node.mark() for node in nodes[:2]]
    newcomer = Launch(hosts, 3, user, [*ELASTICRUN, *argv], env)
    for node, mark in zip((*nodes[:2], newcomer), (*marks, 0), strict=True):
        node.wait_line(WORLD.format(world=3), timeout=120, after=mark)
    hold.unlink()
    codes = [node.wait(240) for node in (*nodes[:2], newcomer)]
    assert codes == [0, 0, 0], [node.story("exit") for node in (*nodes[:2], newcomer)]
    assert left_behind(user, [*names, node_name(newcomer)], hosts) == []

    # torchrun, the same line (max restarts 0: torchrun's default, and elasticrun's)
    torch_argv = line(hosts, "2:3", f"kill-torchrun-{tag}", *script)
    agents = launch_all(hosts, user, TORCHRUN, torch_argv, env, 3)
    for agent in agents:
        agent.wait_line(WORLD.format(world=3), timeout=240)
    agents[2].kill_tree()
    cut = time.monotonic()
    told = []
    for agent in agents[:2]:
        try:
            code = agent.wait(90)
            told.append(f"exit {code} after {time.monotonic() - cut:.1f} s")
        except AssertionError:
            told.append("still running after 90 s (killed)")
    REPORT.append(
        f"a node SIGKILLed mid-training (--nnodes 2:3, 3 nodes): elasticrun: the other two "
        f"re-formed at 2 in {reformed:.1f} s, a new node joined, all exit 0; torchrun: {told}"
    )
    print(REPORT[-1])


def test_ctrl_c_on_one_node_cancels_the_job_everywhere_and_leaves_nothing(hosts, user):
    hosts = hosts(3)
    env = env_of(user)
    tag = uuid.uuid4().hex[:8]
    logs = user.home / "logs"
    argv = line(
        hosts,
        "3",
        f"ctrlc-{tag}",
        "--steps",
        "400",
        "--step-seconds",
        "0.25",
        extra=("--log-dir", str(logs)),
    )
    nodes = launch_all(hosts, user, ELASTICRUN, argv, env, 3)
    for node in nodes:
        node.wait_line(WORLD.format(world=3), timeout=240)
    names = [node_name(node) for node in nodes]
    nodes[1].signal(signal.SIGINT)
    codes = [node.wait(120) for node in nodes]
    assert codes == [130, 130, 130], [node.story("exit") for node in nodes]
    nodes[1].wait_line(r"^elasticrun: job j-[0-9a-f]+ cancelled$", "err", timeout=1)
    assert left_behind(user, names, hosts) == []
    # the logs the user asked for stay: each node's copy of its rank's output
    copies = sorted(path.name for path in logs.rglob("stdout.log"))
    assert copies == ["stdout.log"] * 3, sorted(map(str, logs.rglob("*")))


def test_losing_the_store_host_ends_the_job_everywhere_saying_why(hosts, user):
    hosts = hosts(3)
    env = env_of(user)
    tag = uuid.uuid4().hex[:8]
    argv = line(hosts, "2:3", f"host-{tag}", "--steps", "400", "--step-seconds", "0.25")
    nodes = launch_all(hosts, user, ELASTICRUN, argv, env, 3)
    for node in nodes:
        node.wait_line(WORLD.format(world=3), timeout=240)
    names = [node_name(node) for node in nodes]
    nodes[0].signal(signal.SIGKILL)  # the endpoint's host: its daemon hosts the TCPStore
    cut = time.monotonic()
    for node in nodes[1:]:
        assert node.wait(120) == 1, node.story("exit")
        node.wait_line(r"store at .* has not answered for", "err", timeout=1)
    REPORT.append(
        f"the store's host SIGKILLed (c10d): the others ended (exit 1, saying why) "
        f"{time.monotonic() - cut:.1f} s later"
    )
    assert left_behind(user, names, hosts) == []


def test_on_etcd_the_endpoints_host_is_a_node_like_the_others(hosts, user, shared_tmp):
    from fixtures.etcd import EtcdCluster, require_etcd

    require_etcd()
    hosts = hosts(3)
    etcd = EtcdCluster(
        shared_tmp / "etcd-data",
        host=hosts.addr(1),
        wrap=lambda argv: hosts.exec_argv(1, argv),
    )
    try:
        env = env_of(user)
        tag = uuid.uuid4().hex[:8]
        argv = [
            "--nnodes",
            "2:3",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "etcd-v2",
            "--rdzv-endpoint",
            etcd.endpoints[0],
            "--rdzv-id",
            f"etcd-{tag}",
            "--rdzv-conf",
            f"key_file={key_file(user)}",
            str(TRAIN),
            "--steps",
            "40",
            "--step-seconds",
            "0.25",
        ]
        nodes = launch_all(hosts, user, ELASTICRUN, argv, env, 3)
        for node in nodes:
            node.wait_line(WORLD.format(world=3), timeout=240)
        names = [node_name(node) for node in nodes]
        nodes[0].signal(signal.SIGKILL)  # host 1: where the endpoint (etcd) is
        for node in nodes[1:]:
            node.wait_line(WORLD.format(world=2), timeout=120)
        codes = [node.wait(240) for node in nodes[1:]]
        assert codes == [0, 0], [node.story("exit") for node in nodes[1:]]
        assert left_behind(user, names, hosts) == []
    finally:
        etcd.stop()
