"""Anyone who reaches the store port (docs/security.md, "The store") against real daemons: it reads
nothing secret, cannot make a finished job run again, cannot freeze the cluster with an
unsigned counter, cannot make a node break its own policy, and, where a root daemon's
nftables rule stands, cannot connect at all.

The attacker is torch's own TCPStore client, with no key: ``TCPStore(host, port,
is_master=False, use_libuv=True)`` connected to the store that the first daemon hosts, as
root on the same host (the nftables rule lets root through: that is the point of C9, and
the rows below play what a host outside the cluster, or root's own jobs, could do).  It
reads, deletes, bumps counters and appends lines under ``elasticd/<cluster>/``.  The
daemons are real (2 or 3 on 127.0.0.x, one of them the store host), the jobs are submitted
with the real elasticctl and run real workers.

Rows -> tests:

    C1   nothing secret in the store .......... test_c1_job_environment_is_not_in_the_store
         a standalone daemon has no store port  test_c1_standalone_daemon_listens_on_no_store
    C10  jobs/log counter bumped by 1,000,000 . test_c10_bumped_change_log_does_not_freeze_the_board
    C11  nodes/seq bumped + junk in nodes/names test_c11_node_index_junk_and_counter_do_not_freeze_nodes
    C9   the nftables rule (root, needs nft) .. test_c9_only_root_reaches_the_store_port
         store.firewall = false ............... test_c9_without_the_rule_nobody_connects
    B9   policy where the work runs ........... test_b9_node_that_forbids_root_runs_no_root_job
    C8   deleted outcome + rendezvous state ... test_c8_deleted_outcome_does_not_run_a_finished_job_again
         (a new node n3 with jobs.allow_root false, and true; then, with n3 allowing root,
         the job's spec record written back as it was read while the job ran; and that
         plus every other record of the job erased: its parts and all rendezvous keys)

"Never happens" is observed for a bounded period, stated in each test, while polling the
condition; everything else waits on a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness import PY, Daemon, free_port, needs_root, python_for_everyone, worker_args
from store_attack import REFUSED, Attacker, Cluster, metric, wait_for

from elasticd.store.firewall import table_name

NFT = shutil.which("nft") or shutil.which("nft", path="/usr/sbin:/sbin")
needs_nft = pytest.mark.skipif(NFT is None, reason="needs nft (nftables)")
SETPRIV = shutil.which("setpriv")
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
SECRETS = (b"hunter2", b"SECRET_TOKEN", b"AWS_SECRET_ACCESS_KEY", AWS_SECRET.encode())

# A TCPStore client that tries to use host:port as a store; prints STORE when it can.
PROBE = """
import sys
from datetime import timedelta
try:
    from torch.distributed import TCPStore
    store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, use_libuv=True,
                     timeout=timedelta(seconds=float(sys.argv[3])))
    store.set("probe/key", b"probe-value")
    print("STORE" if store.get("probe/key") == b"probe-value" else "NOT-A-STORE")
except Exception as exc:
    print("REFUSED", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
"""

# A plain TCP connect.
CONNECT = """
import socket, sys
s = socket.socket()
s.settimeout(5)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("CONNECTED")
except ConnectionRefusedError:
    print("REFUSED")
except OSError as exc:
    print("ERROR", exc)
"""

# A job that leaves one line per run of each worker, then ends when the FIFO is released.
APPEND = """
import os, sys
with open(sys.argv[1], "a") as f:
    f.write(f"{os.environ['TORCHELASTIC_RUN_ID']} rank {os.environ['RANK']} "
            f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} pid {os.getpid()}\\n")
with open(sys.argv[2], "rb") as fifo:
    fifo.read()
"""


@pytest.fixture
def cluster(daemon_factory, shared_tmp) -> Cluster:
    return Cluster(daemon_factory, shared_tmp, prefix="frz")


# -- helpers -------------------------------------------------------------------------------------


def listed(daemon: Daemon, job_id: str) -> dict[str, Any] | None:
    """The job as ``elasticctl list --all`` shows it on ``daemon`` (its registry only: list
    never reads the store, so this is what the daemon's board follower has seen)."""
    return next((j for j in daemon.ctl("list", "--all") if j["id"] == job_id), None)


def store_health(daemon: Daemon) -> dict[str, Any]:
    return daemon.ctl("version")["elasticd"]


def nft_tables() -> str:
    return subprocess.run(
        [NFT, "list", "tables"], capture_output=True, text=True, check=True
    ).stdout


def as_nobody(code: str, *args: str, python: str = "/usr/bin/python3", timeout: float = 60) -> str:
    """Run ``python -c code args`` as nobody:nogroup with no supplementary groups."""
    argv = [
        SETPRIV,
        "--reuid=nobody",
        "--regid=nogroup",
        "--clear-groups",
        python,
        "-c",
        code,
        *args,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd="/")
    return (
        done.stdout.strip() or f"(no output; exit {done.returncode}; {done.stderr.strip()[-300:]})"
    )


def job_keys(attacker: Attacker, job_id: str, nodes: list[str]) -> dict[str, bytes]:
    """Every store key of the job (and of the cluster's indexes) that exists now."""
    suffixes = [
        "jobs/index",
        "jobs/index/0",
        "jobs/seq",
        "jobs/log",
        "nodes/names",
        "epoch",
        "ping",
        f"jobs/spec/{job_id}",
        f"jobs/outcome/{job_id}",
        f"jobs/parts/{job_id}",
    ]
    suffixes += [f"jobs/part/{job_id}/{n}" for n in nodes]
    suffixes += [f"nodes/{n}/{what}" for n in nodes for what in ("record", "hb", "drain")]
    head = int(attacker.read("jobs/log") or b"0")
    suffixes += [f"jobs/log/{n}" for n in range(1, head + 1)]
    rdzv = f"rdzv/{job_id}"
    state = attacker.read(f"{rdzv}/state")
    try:
        newest = int(json.loads(state)["ver"]) if state else 0
    except (ValueError, KeyError, TypeError):
        newest = 64
    suffixes += [
        f"{rdzv}/state",
        *(f"{rdzv}/rev/{v}" for v in range(max(0, newest - 40), newest + 3)),
    ]
    suffixes += [f"{rdzv}/hb/{n}" for n in nodes]
    suffixes += [f"{rdzv}/round/{r}/joins" for r in range(4)]
    suffixes += [f"{rdzv}/round/{r}/exit/{n}" for r in range(4) for n in nodes]
    return {s: raw for s in dict.fromkeys(suffixes) if (raw := attacker.read(s)) is not None}


# -- C1: nothing secret in the store ---------------------------------------------------------------


def test_c1_job_environment_is_not_in_the_store(cluster, shared_tmp, figures):
    n1, n2 = cluster.add("n1"), cluster.add("n2")
    cluster.start()
    attacker = Attacker(cluster)
    out = shared_tmp / "env"
    out.mkdir()
    # group rank 0 ends at once and waits at the exit barrier while group rank 1 waits for
    # the gate: the job's keys are read while it runs (state, heartbeats, joins, a barrier
    # arrival) and again once it ended (outcome, every arrival)
    gate = shared_tmp / "gate"
    job = n2.submit(
        "--nnodes",
        "2",
        "--env",
        "SECRET_TOKEN=hunter2",
        *worker_args("--env-out", str(out), "--hold-group", f"1:{gate}"),
        env={"AWS_SECRET_ACCESS_KEY": AWS_SECRET},
    )
    job_id = job["id"]
    n1.wait_job(job_id, lambda d: d.get("barrier") is not None, timeout=60)
    names = [n1.name, n2.name]
    seen = job_keys(attacker, job_id, names)
    gate.touch()
    final = n1.wait_job(
        job_id, lambda d: d["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"), timeout=60
    )
    assert final["state"] == "SUCCEEDED", final
    after = job_keys(attacker, job_id, names)
    everything = {**{f"{k} (running)": v for k, v in seen.items()}, **after}
    figures.add("C1: store keys of the job read raw (running + ended)", str(len(everything)))

    # the test is not vacuous: the job's records are there and were read
    for suffix in (
        f"jobs/spec/{job_id}",
        f"jobs/outcome/{job_id}",
        f"jobs/parts/{job_id}",
        *(f"jobs/part/{job_id}/{n}" for n in names),
    ):
        assert suffix in after, f"{suffix} not in the store: {sorted(after)}"
    assert any(k.startswith(f"rdzv/{job_id}/") for k in everything), sorted(everything)
    for suffix in (f"jobs/spec/{job_id}", *(f"jobs/part/{job_id}/{n}" for n in names)):
        record = json.loads(after[suffix])
        assert "enc" in record and "body" not in record, record  # encrypted, not only signed
    cluster_key = cluster.key.read_text().strip().encode()
    for key, raw in everything.items():
        for needle in (*SECRETS, cluster_key):
            assert needle not in raw, f"{needle!r} is readable at {key}: {raw[:300]!r}"
    # ... nor in a daemon's log
    for daemon in (n1, n2):
        text = daemon.log_path.read_bytes()
        for needle in (b"hunter2", AWS_SECRET.encode(), cluster_key):
            assert needle not in text, f"{needle!r} in {daemon.name}'s log"

    # the workers themselves got the environment (and never the cluster key)
    envs = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]
    for env in envs:
        assert env["SECRET_TOKEN"] == "hunter2" and env["AWS_SECRET_ACCESS_KEY"] == AWS_SECRET
        assert not any(cluster_key.decode() in v for v in env.values())


def test_c1_standalone_daemon_listens_on_no_store(daemon_factory):
    # a node name of its own: job cgroups are named after it (see Cluster)
    daemon = daemon_factory(
        f"s1-{uuid.uuid4().hex[:6]}", args=("--slots", "2"), metrics_port=free_port()
    ).start()
    version = store_health(daemon)
    assert version["store"] == "memory (standalone)" and version["store_up"], version
    text = daemon.ctl_run("version")
    assert text.returncode == 0 and "memory (standalone)" in text.stdout, text.stdout
    proc = psutil.Process(daemon.proc.pid)
    conns = (
        proc.net_connections(kind="tcp")
        if hasattr(proc, "net_connections")
        else proc.connections(kind="tcp")
    )
    listening = sorted(
        {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    )
    assert listening, "the daemon listens on no TCP port at all (not even metrics/peers)?"
    probes = []
    for ip, port in listening:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(ip, ip)
        probes.append(
            (
                (host, port),
                subprocess.Popen(
                    [PY, "-c", PROBE, host, str(port), "3"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                ),
            )
        )
    results = {where: p.communicate(timeout=60)[0].strip() for where, p in probes}
    for where, result in results.items():
        assert result.startswith("REFUSED"), f"a TCPStore client could use {where}: {result}"
    assert daemon.proc.poll() is None  # and the probes did not hurt it
    # its store (in memory) works: a job runs
    assert daemon.submit_wait(*worker_args())["state"] == "SUCCEEDED"


# -- C10: a bumped change-log counter does not freeze the board ------------------------------------


def test_c10_bumped_change_log_does_not_freeze_the_board(cluster, figures):
    nodes = [cluster.add(f"n{i}") for i in (1, 2, 3)]
    cluster.start()
    attacker = Attacker(cluster)
    before = attacker.add("jobs/log", 0)
    assert attacker.add("jobs/log", 1_000_000) == before + 1_000_000
    # --nnodes 3: it runs only if every node's board follower saw it
    submitted = time.monotonic()
    job_id = nodes[1].submit("--nnodes", "3", *worker_args())["id"]

    def everywhere_succeeded() -> bool:
        states = [(listed(d, job_id) or {}).get("state") for d in nodes]
        assert not set(states) & {"FAILED", "CANCELLED"}, states
        return states == ["SUCCEEDED"] * 3

    wait_for(everywhere_succeeded, 15, f"{job_id} SUCCEEDED on every node after jobs/log += 1e6")
    took = time.monotonic() - submitted
    # and the log is followed from its new head on: the next job needs every node again
    second = nodes[2].submit("--nnodes", "3", *worker_args())["id"]
    wait_for(
        lambda: [(listed(d, second) or {}).get("state") for d in nodes] == ["SUCCEEDED"] * 3,
        15,
        f"a second job {second} SUCCEEDED on every node",
    )
    figures.add(
        "C10: submit -> SUCCEEDED on all 3 nodes after jobs/log += 1,000,000", f"{took:.1f} s"
    )


# -- C11: a bumped node counter and junk in the node index do not freeze the nodes -----------------


def test_c11_node_index_junk_and_counter_do_not_freeze_nodes(cluster, figures):
    nodes = [cluster.add(f"n{i}") for i in (1, 2, 3)]
    cluster.start()
    names = sorted(d.name for d in nodes)
    wait_for(
        lambda: all(sorted(n["name"] for n in d.ctl("nodes")) == names for d in nodes),
        15,
        "every node sees all three",
    )
    refused_before = [metric(d, REFUSED) for d in nodes]
    attacker = Attacker(cluster)
    attacker.add("nodes/seq", 300_000)
    junk = []
    for i in range(1000):
        junk.append(
            [
                os.urandom(48).replace(b"\n", b"?"),
                b'{"v":2,"ver":0,"body":{"name":"ghost%d"},"mac":"%s"}' % (i, b"0" * 64),
                b"x" * 2000,
                b'{"name":"ghost%d"}' % i,
            ][i % 4]
        )
    attacker.append("nodes/names", b"\n".join(junk) + b"\n")

    # watched for 5 s (more than keep_alive_interval x keep_alive_max_attempt = 3 s, the
    # time after which a node whose heartbeats are not read would turn lost)
    started, rounds = time.monotonic(), 0
    while time.monotonic() - started < 5.0 or rounds < 2:
        for daemon in nodes:
            health = store_health(daemon)
            assert health["store_up"], f"{daemon.name}: store unreachable after the junk: {health}"
            listing = daemon.ctl("nodes")
            assert sorted(n["name"] for n in listing) == names, listing  # no ghost
            assert all(n["state"] == "up" for n in listing), (daemon.name, listing)
        rounds += 1
    job = nodes[2].submit("--nnodes", "3", *worker_args())
    final = nodes[0].wait_job(
        job["id"], lambda d: d["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"), timeout=30
    )
    assert final["state"] == "SUCCEEDED", final
    refused = wait_for(
        lambda: (
            (r := [metric(d, REFUSED) - b for d, b in zip(nodes, refused_before)])
            and all(x >= 1000 for x in r)
            and r
        ),
        10,
        "each daemon counts the 1000 junk lines refused",
    )
    for daemon in nodes:
        assert "unreachable" not in daemon.log_path.read_text(errors="replace").lower(), (
            daemon.log_text()
        )
    figures.add(
        "C11: records refused per daemon after 1000 junk lines in nodes/names",
        " / ".join(f"{x:.0f}" for x in refused),
    )


# -- C9: the nftables rule: only root reaches the store port ---------------------------------------


@needs_root
@needs_nft
@pytest.mark.root
@pytest.mark.skipif(SETPRIV is None, reason="needs setpriv")
def test_c9_only_root_reaches_the_store_port(cluster, figures):
    n1, n2 = cluster.add("n1"), cluster.add("n2")
    cluster.start()
    tables = [table_name(cluster.name, d.name) for d in (n1, n2)]
    listed_tables = nft_tables()
    for table in tables:
        assert f"table inet {table}" in listed_tables, listed_tables
    port = str(cluster.port)
    # nobody: the connection is refused, and a TCPStore client gets nowhere
    assert as_nobody(CONNECT, "127.0.0.1", port) == "REFUSED"
    probe = as_nobody(PROBE, "127.0.0.1", port, "5", python=f"{python_for_everyone()}/bin/python3")
    assert probe.startswith("REFUSED"), probe
    # root: its connection and its elasticctl work, on both nodes
    done = subprocess.run(
        [PY, "-c", CONNECT, "127.0.0.1", port], capture_output=True, text=True, timeout=30
    )
    assert done.stdout.strip() == "CONNECTED", done
    for daemon in (n1, n2):
        assert store_health(daemon)["store_up"]
        assert sorted((n["name"], n["state"]) for n in daemon.ctl("nodes")) == [
            (n1.name, "up"),
            (n2.name, "up"),
        ]
    # the rule goes with its daemon
    assert n2.stop() == 0 and n1.stop() == 0
    listed_tables = nft_tables()
    for table in tables:
        assert f"table inet {table}" not in listed_tables, listed_tables
    figures.add("C9: nobody's connect to the store port (rule on)", "refused")


@needs_root
@needs_nft
@pytest.mark.root
@pytest.mark.skipif(SETPRIV is None, reason="needs setpriv")
def test_c9_without_the_rule_nobody_connects(cluster):
    n1 = cluster.add("n1", firewall=False)
    cluster.start()
    assert f"table inet {table_name(cluster.name, n1.name)}" not in nft_tables()
    port = str(cluster.port)
    assert as_nobody(CONNECT, "127.0.0.1", port) == "CONNECTED"
    probe = as_nobody(PROBE, "127.0.0.1", port, "5", python=f"{python_for_everyone()}/bin/python3")
    assert probe == "STORE", probe  # what the rule keeps out
    assert store_health(n1)["store_up"]


# -- B9: policy is checked where the work runs ------------------------------------------------------


@needs_root
@pytest.mark.root
def test_b9_node_that_forbids_root_runs_no_root_job(cluster, shared_tmp):
    n1 = cluster.add("n1", allow_root=True)
    n2 = cluster.add("n2", allow_root=False)
    cluster.start()
    out = shared_tmp / "env"
    out.mkdir()
    job_id = n1.submit("--nodes", n2.name, *worker_args("--env-out", str(out), "--sleep", "0"))[
        "id"
    ]
    refusal = f"job {job_id}: not run on {n2.name}"
    wait_for(lambda: refusal in n2.log_path.read_text(errors="replace"), 15, f"n2 logs {refusal!r}")
    n2_logs = n2.state_dir / "logs" / job_id
    started = time.monotonic()
    while time.monotonic() - started < 3.0:  # "never": watched for 3 s after n2 refused it
        for daemon in (n1, n2):
            status = daemon.ctl("status", job_id)
            assert status["state"] == "PENDING" and not status["workers"] and not status["nodes"], (
                status
            )
        assert not list(out.iterdir()), f"a worker ran: {list(out.iterdir())}"
        assert not n2_logs.exists(), f"n2 started workers: {list(n2_logs.rglob('*'))}"
        time.sleep(0.25)
    line = next(ln for ln in n2.log_path.read_text(errors="replace").splitlines() if refusal in ln)
    assert "allow_root" in line, line
    assert n1.ctl("cancel", job_id)["state"] == "CANCELLED"
    wait_for(
        lambda: (listed(n2, job_id) or {}).get("state") == "CANCELLED", 10, "n2 sees the cancel"
    )


# -- C8: a deleted outcome never makes a finished job run again ------------------------------------


def release(fifo: Path, timeout: float = 30.0) -> None:
    """Let the reader of ``fifo`` go (an open for writing fails until it has opened it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"nobody opened {fifo} within {timeout} s") from None
            time.sleep(0.05)


FIRST_COME = "[scheduler]\nenabled = false\n"


@needs_root
@pytest.mark.root
@pytest.mark.parametrize(
    "n3_allows_root, attack, config",
    [
        (False, "delete", ""),
        (True, "delete", ""),
        (True, "delete+spec", ""),
        (True, "erase+spec", ""),
        pytest.param(
            True,
            "erase+spec",
            FIRST_COME,
            marks=pytest.mark.xfail(
                strict=True,
                reason=(
                    "a known limit (docs/security.md, The store) where the scheduler is off: a node that never "
                    "saw the job cannot tell the spec as submitted, written back with every later record "
                    "erased, from a new job; with the scheduler on it follows the schedule of a node that "
                    "saw the job end"
                ),
            ),
        ),
    ],
    ids=[
        "n3-forbids-root",
        "n3-allows-root",
        "n3-allows-root-spec-written-back",
        "n3-allows-root-all-erased-spec-written-back",
        "first-come-all-erased-spec-written-back",
    ],
)
def test_c8_deleted_outcome_does_not_run_a_finished_job_again(
    cluster, shared_tmp, n3_allows_root, attack, config, figures
):
    """The attacker deletes the ended job's outcome and rendezvous state.  "+spec": it also
    writes back the job's spec record as it read it while the job ran (a valid record of
    that key, from before the job's end was sealed into it).  "erase": it deletes every
    other record of the job it can name too (its parts, their index, every rendezvous
    key).  A node that joins afterwards never saw the job run: it must not run it again."""
    n1 = cluster.add("n1", allow_root=True, config=config)
    cluster.add("n2", allow_root=False, config=config)
    cluster.start()
    attacker = Attacker(cluster)
    script = shared_tmp / "append.py"
    script.write_text(APPEND)
    runs, fifo = shared_tmp / "runs.txt", shared_tmp / "release"
    os.mkfifo(fifo)
    job_id = n1.submit("--nnodes", "1", str(script), str(runs), str(fifo))["id"]
    wait_for(lambda: runs.exists() and runs.read_text(), 30, f"{job_id} ran")
    submitted_spec = attacker.read(f"jobs/spec/{job_id}")  # what the store held while it ran
    release(fifo)
    done = n1.wait_job(
        job_id, lambda d: d["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"), timeout=30
    )
    assert done["state"] == "SUCCEEDED", done
    assert len(runs.read_text().splitlines()) == 1
    # the outcome comes first, n1's part's last state and its rendezvous keeper's last
    # write just after: the attack starts once n1 closed its part (a deleted key that n1
    # writes again would be n1's doing, not the attacker's failure)
    wait_for(lambda: "heard PartClosed" in n1.stories(), 30, f"n1 closed its part of {job_id}")

    doomed = [f"jobs/outcome/{job_id}", f"rdzv/{job_id}/state"]
    if attack.startswith("erase"):
        doomed += [
            k
            for k in job_keys(attacker, job_id, [d.name for d in cluster.daemons])
            if k.startswith((f"rdzv/{job_id}/", f"jobs/part/{job_id}/", f"jobs/parts/{job_id}"))
        ]
    for suffix in dict.fromkeys(doomed):
        assert attacker.exists(suffix), suffix
        attacker.delete(suffix)
        assert not attacker.exists(suffix), suffix
    if attack.endswith("+spec"):
        assert submitted_spec is not None and b'"ver":0' in submitted_spec, submitted_spec
        attacker.store.set(attacker.key(f"jobs/spec/{job_id}"), submitted_spec)

    n3 = cluster.add("n3", allow_root=n3_allows_root, config=config)
    n3.start()
    # n3 learned of the job (so it had every chance to take it)
    seen = wait_for(lambda: listed(n3, job_id), 15, f"n3 lists {job_id}")
    n3_logs = n3.state_dir / "logs" / job_id
    observed = 5.0
    started = time.monotonic()
    while time.monotonic() - started < observed:  # "never": watched for 5 s after n3 is up
        lines = runs.read_text().splitlines()
        assert len(lines) == 1, f"the finished job ran again: {lines}\n{n3.log_text()}"
        assert not n3_logs.exists(), f"n3 started workers of {job_id}: {list(n3_logs.rglob('*'))}"
        status = n3.ctl("status", job_id)
        assert not any(w.get("node") == n3.name for w in status["workers"]), status
        assert not any(
            p["node"] == n3.name and p["state"] in ("RUNNING", "BARRIER") for p in status["nodes"]
        ), status
        time.sleep(0.25)
    assert n1.ctl("status", job_id)["state"] == "SUCCEEDED"
    variant = f"{'allow' if n3_allows_root else 'forbid'} root on n3, {attack}"
    figures.add(
        f"C8 ({variant}): the job as n3 shows it after the attack",
        f"{seen['state']}, {len(runs.read_text().splitlines())} run",
    )
