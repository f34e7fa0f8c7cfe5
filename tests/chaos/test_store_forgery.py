"""Anyone who reaches the store port (docs/security.md, "The store") forges, copies and replays
store records against real daemons: no daemon acts on them.

The attacker is torch's own TCPStore client, with no key: ``TCPStore(host, port,
is_master=False, use_libuv=True, timeout=10 s)`` connected to the cluster's store, which the
first daemon hosts.  It reads raw bytes under ``elasticd/<cluster>/``, copies validly sealed
records of one job or node onto the keys of another, writes back an older record of the
same key, writes unsigned and garbage values, bumps counters and sets unsigned wake-up keys.
It never has the cluster key: every record it can write is either garbage, unsigned, or a
sealed record that some daemon wrote for another key or an older version.  (The test itself
reads the key file only to create it.)

The daemons are real (2 on 127.0.0.1 / 127.0.0.2, the first one the store host), the jobs
are submitted with the real elasticctl and run real workers.  Node names carry a random tag
("n1" is n1-<tag>): a daemon's job cgroups are named after its node and it kills what it
finds in them at start, so two test runs on one host must not share node names.

Rows -> tests:

    C3  a finished job's signed outcome copied onto a running job's outcome key (plus a
        forged change-log entry so that daemons look) ..... test_c3_copied_outcome_does_not_end_a_running_job
    C4  a finished job's closed rendezvous state copied onto a running job's state key, and
        its revision keys set to wake the watchers ........ test_c4_copied_rendezvous_state_does_not_stop_a_running_job
        ... and costs a back-off, not a spin .............. test_c4_copied_rendezvous_state_costs_a_back_off_not_a_spin
    C5  a node's old drain request replayed onto another node's key and back onto its own
        after an undrain .................................. test_c5_replayed_drain_request_drains_no_node
    C6  forged and copied exit-barrier arrivals (and the legacy unsigned barrier keys) for a
        member still working ............................. test_c6_forged_exit_barrier_arrival_does_not_end_the_job
    C2  garbage and unsigned outcomes over running jobs (held; the owner's cancel replaces
        them) and garbage over a finished job's outcome (never runs again; cancel says it
        ended) ............................................ test_c2_unsigned_outcome_holds_a_job_and_never_reruns_one
    C12 a finished job's signed records (spec, outcome, parts and their index, rendezvous
        state) copied onto a running job's keys, then a member restarted (SIGKILL, SIGTERM):
        held on every node, saying who refuses what, never RUNNING with nothing running,
        counted, and the owner's cancel ends it ......... test_c12_copied_records_and_a_restarted_member_hold_the_job_everywhere
    C13 a finished job's rendezvous state copied onto a job whose every member was down: no
        member can restore it, so each holds the job ..... test_c13_a_rendezvous_state_no_member_can_restore_holds_the_job

Each test asserts the safe outcome and that a daemon counted the refusal
(``elasticd_store_refused_records_total``) and logged it ("refused store record <key>: ...").
Conditions are waited for with a deadline; "never happens" is observed for a bounded period
(stated in each test: at least 3 heartbeat intervals of 1 s) while polling the condition.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import Daemon, alive, wait_gone, worker_args
from store_attack import REFUSED, Attacker, Cluster, metric, node_states, wait_for

HEARTBEAT = 1.0  # rendezvous.keep_alive_interval (the default): one heartbeat duty
OBSERVE = 3 * HEARTBEAT + 0.5  # "never" is watched for 3 heartbeat intervals (and a margin)
ENDED = ("SUCCEEDED", "FAILED", "CANCELLED")

# A job that leaves one line per run of each worker.
APPEND = """
import os, sys
with open(sys.argv[1], "a") as f:
    f.write(f"{os.environ['TORCHELASTIC_RUN_ID']} rank {os.environ['RANK']} "
            f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} pid {os.getpid()}\\n")
"""

# Group rank 1 works for argv[2] seconds, then writes argv[1] (its pid); group rank 0 ends at once.
SLOW_MEMBER = """
import os, sys, time
if os.environ["GROUP_RANK"] == "1":  # argv: marker, seconds of work, gate
    print(f"working {os.getpid()}", flush=True)
    while not os.path.exists(sys.argv[3]):  # the test's attack is on before the work
        time.sleep(0.05)
    time.sleep(float(sys.argv[2]))
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
"""


@pytest.fixture
def cluster(daemon_factory, shared_tmp) -> Cluster:
    """store.firewall is off: the attacker played here is one the nftables rule does not stop
    (root, or a host outside the cluster; C9 in test_store_freeze.py tests the rule itself)."""
    return Cluster(daemon_factory, shared_tmp, prefix="frg", firewall=False)


def forge_change(attacker: Attacker, entry: str) -> int:
    """Bump the change-log counter and write an unsigned entry naming ``entry`` at the new
    head, so that every daemon's board follower wakes up and looks; returns its number."""
    n = attacker.add("jobs/log", 1)
    attacker.write(
        f"jobs/log/{n}",
        b'{"v":2,"ver":0,"body":%s,"mac":"%s"}' % (json.dumps(entry).encode(), b"0" * 64),
    )
    return n


# -- helpers -------------------------------------------------------------------------------------


def observe(seconds: float, check: Callable[[], None], interval: float = 0.25) -> int:
    """Run ``check`` (which asserts) again and again for ``seconds``, at least twice; returns
    how often it ran."""
    started, rounds = time.monotonic(), 0
    while time.monotonic() - started < seconds or rounds < 2:
        check()
        rounds += 1
        time.sleep(interval)
    return rounds


def refused_counts(cluster: Cluster) -> list[float]:
    return [metric(d, REFUSED) for d in cluster]


def refusal_logged(daemon: Daemon, key: str) -> str | None:
    """The daemon's first log line that refuses the record at ``key`` (the full store key)."""
    needle = f"refused store record {key}:"
    return next(
        (
            line
            for line in daemon.log_path.read_text(errors="replace").splitlines()
            if needle in line
        ),
        None,
    )


def wait_refused(
    cluster: Cluster, before: list[float], key: str, *, every: bool = False, timeout: float = 15.0
) -> list[str]:
    """Until the refusal of ``key`` is counted and logged by one daemon (``every``: by each);
    returns the log lines."""
    daemons = list(cluster)

    def seen() -> list[str] | None:
        counts = refused_counts(cluster)
        found = [
            (d, line)
            for d, b, c in zip(daemons, before, counts)
            if c > b and (line := refusal_logged(d, key))
        ]
        if (every and len(found) < len(daemons)) or not found:
            return None
        return [line for _, line in found]

    return wait_for(
        seen,
        timeout,
        f"the refusal of {key} counted and logged by {'every daemon' if every else 'a daemon'}",
    )


def status(daemon: Daemon, job_id: str) -> dict[str, Any]:
    """The job's document, as ``elasticctl --json status`` prints it: the same request, made
    here (looks repeated every 0.25 s spent most of their time starting elasticctl)."""
    reply = daemon.request("status", job=job_id)
    assert reply.ok, f"{daemon.name}: status {job_id}: {reply.code}: {reply.message}"
    return reply.result


def worker_pids(doc: dict[str, Any]) -> dict[int, int]:
    """rank -> pid of the job's workers, as a status document shows them."""
    return {w["rank"]: w["pid"] for w in doc["workers"]}


def two_node_job(submitter: Daemon, directory: Path, *options: str) -> tuple[str, dict[int, int]]:
    """A job on two nodes, one sleeping worker each; returns its id and rank -> pid, once
    every worker wrote its pid file."""
    pids_dir = directory / f"pids-{uuid.uuid4().hex[:6]}"
    pids_dir.mkdir()
    job_id = submitter.submit(
        "--nnodes", "2", *options, *worker_args("--sleep", "0", "--pid-dir", str(pids_dir))
    )["id"]
    doc = submitter.wait_running(job_id, 2, timeout=60)
    wait_for(
        lambda: all((pids_dir / f"rank_{r}.pid").exists() for r in range(2)),
        30,
        f"{job_id}'s workers wrote their pid files",
    )
    pids = {r: int((pids_dir / f"rank_{r}.pid").read_text().split()[0]) for r in range(2)}
    assert worker_pids(doc) == pids, (worker_pids(doc), pids)
    return job_id, pids


def assert_still_running(cluster: Cluster, job_id: str, pids: dict[int, int]) -> None:
    """On every daemon: the job RUNNING with no restart, these same workers; each alive."""
    for daemon in cluster:
        doc = status(daemon, job_id)
        assert doc["state"] == "RUNNING", f"{daemon.name}: {job_id} is {doc['state']}: {doc}"
        assert doc["restarts"] == 0, f"{daemon.name}: {job_id} restarted: {doc}"
        assert worker_pids(doc) == pids, (
            f"{daemon.name}: {job_id}'s workers changed: {doc['workers']}"
        )
    for rank, pid in pids.items():
        assert alive(pid), f"{job_id}'s rank {rank} (pid {pid}) was stopped"


def cancel_and_check(cluster: Cluster, owner: Daemon, job_id: str, pids: dict[int, int]) -> None:
    """The owner's elasticctl cancel ends the job CANCELLED everywhere and stops its workers."""
    assert owner.ctl("cancel", job_id)["state"] == "CANCELLED"
    for daemon in cluster:
        final = daemon.wait_job(job_id, lambda d: d["state"] in ENDED, timeout=30)
        assert final["state"] == "CANCELLED", (daemon.name, final)
        assert not final["held"], (daemon.name, final)
    assert wait_gone(list(pids.values()), timeout=30) == [], (
        f"{job_id}'s workers outlived the cancel"
    )


# -- C3: a copied outcome does not end a running job ------------------------------------------------


@pytest.mark.slow
def test_c3_copied_outcome_does_not_end_a_running_job(cluster, shared_tmp, figures):
    n1, n2 = cluster.add("n1"), cluster.add("n2")
    cluster.start()
    attacker = Attacker(cluster)
    a = n1.submit_wait("--nnodes", "1", *worker_args())
    assert a["state"] == "SUCCEEDED", a
    b, pids = two_node_job(n2, shared_tmp)
    outcome_a = attacker.read(f"jobs/outcome/{a['id']}")
    # A's valid outcome, encrypted: the attacker cannot read how it ended, only copy it
    assert outcome_a is not None and b'"enc"' in outcome_a, outcome_a
    assert b"SUCCEEDED" not in outcome_a, outcome_a
    assert attacker.read(f"jobs/outcome/{b}") is None

    before = refused_counts(cluster)
    attacker.write(f"jobs/outcome/{b}", outcome_a)
    forge_change(attacker, f"outcome/{b}")
    key = attacker.key(f"jobs/outcome/{b}")
    lines = wait_refused(cluster, before, key, every=True)
    assert all("copied from another key" in line for line in lines), lines
    # the outcome does not open: every daemon holds the job (docs/security.md: HELD)
    wait_for(lambda: all(status(d, b)["held"] for d in cluster), 15, f"{b} held on every node")

    # "never": for 3 heartbeat intervals after every daemon refused it, B is not SUCCEEDED
    # (nor ended at all) and its workers run on, the same processes
    observe(OBSERVE, lambda: assert_still_running(cluster, b, pids))
    for daemon in cluster:
        assert (listed := next(j for j in daemon.ctl("list", "--all") if j["id"] == b))[
            "state"
        ] == "RUNNING", listed
    figures.add(
        "C3: refusals of the copied outcome counted (n1 / n2)",
        " / ".join(f"{c - b0:.0f}" for c, b0 in zip(refused_counts(cluster), before)),
    )

    # the owner's cancel replaces the copy with a valid outcome
    cancel_and_check(cluster, n2, b, pids)
    assert attacker.read(f"jobs/outcome/{b}") != outcome_a


# -- C4: a copied rendezvous state does not stop a running job ----------------------------------------


def copy_closed_state(cluster: Cluster, shared_tmp: Path) -> dict[str, Any]:
    """Finished 2-node job A, running 2-node job B; then A's closed (validly signed) rendezvous
    state copied onto B's state key and B's next revision keys set to wake its watchers."""
    n1, _ = cluster.add("n1"), cluster.add("n2")
    cluster.start()
    attacker = Attacker(cluster)
    a = n1.submit_wait("--nnodes", "2", *worker_args())
    assert a["state"] == "SUCCEEDED", a
    state_a = attacker.read(f"rdzv/{a['id']}/state")
    assert state_a is not None
    assert json.loads(state_a)["body"]["closed"] is True, (
        state_a
    )  # A's closed state, validly signed
    b, pids = two_node_job(n1, shared_tmp)
    state_b = attacker.read(f"rdzv/{b}/state")
    assert state_b is not None
    version = json.loads(state_b)["ver"]

    before = refused_counts(cluster)
    attacker.write(f"rdzv/{b}/state", state_a)
    for v in range(version + 1, version + 4):  # wake every watcher of B's rendezvous
        attacker.write(f"rdzv/{b}/rev/{v}", b"1")
    copied = time.monotonic()
    return {
        "attacker": attacker,
        "a": a["id"],
        "b": b,
        "pids": pids,
        "state_a": state_a,
        "state_b": state_b,
        "before": before,
        "copied": copied,
    }


@pytest.mark.slow
def test_c4_copied_rendezvous_state_does_not_stop_a_running_job(cluster, shared_tmp, figures):
    c = copy_closed_state(cluster, shared_tmp)
    attacker, b, pids, state_a = c["attacker"], c["b"], c["pids"], c["state_a"]
    key = attacker.key(f"rdzv/{b}/state")
    # both nodes run B, but the first to restore it may spare the other the read: one counts it
    lines = wait_refused(cluster, c["before"], key)
    assert all("MAC" in line for line in lines), lines
    # the refused state is replaced by the newest one a member saw
    wait_for(
        lambda: attacker.read(f"rdzv/{b}/state") not in (state_a, None),
        15,
        f"{b}'s rendezvous state written back over the copy",
    )

    # "never": for 3 heartbeat intervals after the copy was refused, B runs on (RUNNING, not
    # PENDING or RESTARTING, no restart) with the same workers
    observe(OBSERVE, lambda: assert_still_running(cluster, b, pids))
    restored = json.loads(attacker.read(f"rdzv/{b}/state"))
    original = json.loads(c["state_b"])
    assert restored["body"]["closed"] is False, restored
    assert restored["body"]["round"] == original["body"]["round"], (restored, original)
    assert sorted(restored["body"]["participants"]) == sorted(original["body"]["participants"]), (
        restored
    )
    figures.add(
        "C4: refusals of the copied rendezvous state (n1 / n2)",
        " / ".join(f"{x - y:.0f}" for x, y in zip(refused_counts(cluster), c["before"])),
    )
    cancel_and_check(cluster, cluster.daemons[0], b, pids)


# At most this many refusals per daemon while a copied state and forged revision keys stand:
# a refused wake-up costs a back-off of one heartbeat interval, so an honest daemon refuses a
# handful per second (the state once or twice before it writes it back, then each forged
# revision key about once per interval); a daemon that re-reads in a loop refuses thousands.
SPIN_BOUND = 50


@pytest.mark.slow
def test_c4_copied_rendezvous_state_costs_a_back_off_not_a_spin(cluster, shared_tmp, figures):
    c = copy_closed_state(cluster, shared_tmp)
    attacker, b, pids = c["attacker"], c["b"], c["pids"]
    wait_refused(cluster, c["before"], attacker.key(f"rdzv/{b}/state"))
    wait_for(
        lambda: attacker.read(f"rdzv/{b}/state") not in (c["state_a"], None),
        15,
        f"{b}'s rendezvous state written back over the copy",
    )
    # counted over 3 heartbeat intervals after the copy (the forged revision keys stay)
    observe(
        OBSERVE - (time.monotonic() - c["copied"]), lambda: assert_still_running(cluster, b, pids)
    )
    took = time.monotonic() - c["copied"]
    counts = [x - y for x, y in zip(refused_counts(cluster), c["before"])]
    state_lines = [
        sum(
            1
            for line in d.log_path.read_text(errors="replace").splitlines()
            if f"refused store record {attacker.key(f'rdzv/{b}/state')}:" in line
        )
        for d in cluster
    ]
    figures.add(
        f"C4: records refused per daemon in {took:.1f} s after one copied state + 3 revision keys",
        " / ".join(f"{x:.0f}" for x in counts) + f" (state refusals logged: {state_lines})",
    )
    assert all(x <= SPIN_BOUND for x in counts), (
        f"each daemon refused {counts} records in {took:.1f} s after one copied rendezvous state "
        f"({state_lines} log lines refusing the state): the keeper re-reads a refused state in a loop "
        f"instead of backing off"
    )
    cancel_and_check(cluster, cluster.daemons[0], b, pids)


# -- C5: a replayed drain request drains no node ------------------------------------------------------


@pytest.mark.slow
def test_c5_replayed_drain_request_drains_no_node(cluster, shared_tmp, figures):
    n1, n2 = cluster.add("n1"), cluster.add("n2")
    cluster.start()
    attacker = Attacker(cluster)
    names = [n1.name, n2.name]

    # a legitimate drain of n1, seen by both nodes; its record captured; then undone
    n2.ctl("drain", n1.name)
    wait_for(
        lambda: all(node_states(d)[n1.name] in ("draining", "drained") for d in cluster),
        15,
        f"{n1.name} draining on every node",
    )
    drain_v1 = attacker.read(f"nodes/{n1.name}/drain")
    assert drain_v1 is not None and b'"drain":true' in drain_v1, drain_v1
    n2.ctl("undrain", n1.name)
    # n1 itself took the undrain (its own list shows its own record, as of now) and the others saw it
    wait_for(
        lambda: all(node_states(d) == {n: "up" for n in names} for d in cluster),
        15,
        "every node up again after the undrain",
    )
    assert attacker.read(f"nodes/{n1.name}/drain") != drain_v1
    assert attacker.read(f"nodes/{n2.name}/drain") is None

    job, pids = two_node_job(n1, shared_tmp)
    before = refused_counts(cluster)
    attacker.write(f"nodes/{n2.name}/drain", drain_v1)  # another node's request: copied
    attacker.write(f"nodes/{n1.name}/drain", drain_v1)  # its own, older than the undrain: replayed
    n2_line = wait_refused(cluster, before, attacker.key(f"nodes/{n2.name}/drain"))
    n1_line = wait_refused(cluster, before, attacker.key(f"nodes/{n1.name}/drain"))
    assert refusal_logged(n2, attacker.key(f"nodes/{n2.name}/drain")), n2.log_text()
    assert refusal_logged(n1, attacker.key(f"nodes/{n1.name}/drain")), n1.log_text()
    assert "older" in refusal_logged(n1, attacker.key(f"nodes/{n1.name}/drain")), n1_line

    def safe() -> None:
        for daemon in cluster:
            assert node_states(daemon) == {n: "up" for n in names}, (
                daemon.name,
                daemon.ctl("nodes"),
            )
        assert_still_running(cluster, job, pids)

    # "never": for 3 heartbeat intervals (a node reads its drain key at every duty) after both
    # refusals, neither node drains and the job on them keeps its workers
    observe(OBSERVE, safe)
    after = refused_counts(cluster)
    assert after[0] > before[0] and after[1] > before[1], (before, after)
    figures.add(
        "C5: refusals of the replayed drain requests (n1 / n2)",
        " / ".join(f"{c - b0:.0f}" for c, b0 in zip(after, before)),
    )
    cancel_and_check(cluster, n1, job, pids)
    assert n2_line and n1_line


# -- C6: a forged exit-barrier arrival does not end the job ------------------------------------------


@pytest.mark.slow
def test_c6_forged_exit_barrier_arrival_does_not_end_the_job(cluster, shared_tmp, figures):
    n1 = cluster.add("n1")
    cluster.add("n2")
    cluster.start()
    attacker = Attacker(cluster)
    script = shared_tmp / "slow_member.py"
    script.write_text(SLOW_MEMBER)
    marker, gate = shared_tmp / "slow-member-done", shared_tmp / "slow-member-go"
    work = 5.0
    job_id = n1.submit("--nnodes", "2", str(script), str(marker), str(work), str(gate))["id"]
    # group rank 0 ended and waits at the exit barrier; group rank 1 works
    doc = n1.wait_job(
        job_id,
        lambda d: (
            d["state"] == "RUNNING"
            and d.get("barrier") is not None
            and any(p["state"] == "RUNNING" for p in d["nodes"])
            # a node's record may still list its workers as they were before they started
            and all(w["pid"] for w in d["workers"] if w["state"] != "SUCCEEDED")
        ),
        timeout=60,
    )
    slow = next(p["node"] for p in doc["nodes"] if p["state"] == "RUNNING")
    fast = next(p["node"] for p in doc["nodes"] if p["state"] == "BARRIER")
    slow_pid = next(
        w["pid"]
        for w in doc["workers"]
        if w["rank"] == next(p["ranks"][0] for p in doc["nodes"] if p["node"] == slow)
    )
    assert not marker.exists()
    round_ = doc["round"]
    exit_prefix = f"rdzv/{job_id}/round/{round_}/exit"
    fast_arrival = wait_for(lambda: attacker.read(f"{exit_prefix}/{fast}"), 10, f"{fast}'s arrival")
    assert attacker.read(f"{exit_prefix}/{slow}") is None

    before = refused_counts(cluster)
    forged = b'{"v":2,"ver":0,"body":{"node":"%s"},"mac":"00"}' % slow.encode()
    attacker.write(f"{exit_prefix}/{slow}", forged)
    for legacy, value in (("done", b"1"), ("count", b"2"), ("1", b"1"), ("2", b"1")):
        attacker.write(f"{exit_prefix}/{legacy}", value)
    key = attacker.key(f"{exit_prefix}/{slow}")
    wait_refused(cluster, before, key)
    # then the fast member's valid arrival, copied onto the slow member's key
    copied_before = refused_counts(cluster)
    attacker.write(f"{exit_prefix}/{slow}", fast_arrival)
    wait_refused(cluster, copied_before, key)
    gate.touch()  # the slow member's work begins only now: its own arrival cannot race ours

    # until the slow worker wrote its marker (it works 5 s from the gate) the job is not
    # over on any node and the slow worker lives: observed for all of its work
    def not_over() -> None:
        for daemon in cluster:
            state = status(daemon, job_id)["state"]
            # the marker is written before the member exits, so before the job can end: read
            # after the state, it tells whether the job ended before its member finished
            assert state not in ENDED or marker.exists(), (
                f"{daemon.name}: {job_id} {state} before its member finished"
            )
        assert alive(slow_pid) or marker.exists(), f"the working member (pid {slow_pid}) was killed"

    deadline = time.monotonic() + work + 20
    while not marker.exists():
        assert time.monotonic() < deadline, "the working member never wrote its marker"
        not_over()
        time.sleep(0.2)
    assert int(marker.read_text()) == slow_pid
    for daemon in cluster:
        final = daemon.wait_job(job_id, lambda d: d["state"] in ENDED, timeout=30)
        assert final["state"] == "SUCCEEDED", (daemon.name, final)
        # and it ended after the member finished, by the outcome's own clock (this host's)
        assert final["ended"] >= marker.stat().st_mtime, (
            daemon.name,
            final["ended"],
            marker.stat().st_mtime,
        )
    after = refused_counts(cluster)
    figures.add(
        "C6: refusals of the forged/copied exit arrivals (n1 / n2)",
        " / ".join(f"{c - b0:.0f}" for c, b0 in zip(after, before)),
    )


# -- C2: an unsigned outcome holds a running job and never reruns a finished one ----------------------


@pytest.mark.slow
def test_c2_unsigned_outcome_holds_a_job_and_never_reruns_one(cluster, shared_tmp, figures):
    n1, n2 = cluster.add("n1"), cluster.add("n2")
    cluster.start()
    attacker = Attacker(cluster)
    script = shared_tmp / "append.py"
    script.write_text(APPEND)
    runs = shared_tmp / "runs.txt"
    finished = n1.submit_wait("--nnodes", "1", str(script), str(runs))
    assert finished["state"] == "SUCCEEDED", finished
    f_id = finished["id"]
    assert len(runs.read_text().splitlines()) == 1
    garbled, garbled_pids = two_node_job(n1, shared_tmp)  # gets garbage as its outcome
    unsigned, unsigned_pids = two_node_job(n2, shared_tmp)  # gets a plausible unsigned outcome

    before = refused_counts(cluster)
    attacker.write(f"jobs/outcome/{garbled}", b"\x00\xffnot a record\n{")
    attacker.write(
        f"jobs/outcome/{unsigned}",
        json.dumps(
            {
                "state": "SUCCEEDED",
                "ended": time.time(),
                "exit_code": 0,
                "message": "",
                "by": n1.name,
                "error": None,
            }
        ).encode(),
    )
    attacker.write(f"jobs/outcome/{f_id}", b"garbage over a finished job's outcome")
    forge_change(attacker, f"outcome/{unsigned}")
    for job in (garbled, unsigned, f_id):
        wait_refused(cluster, before, attacker.key(f"jobs/outcome/{job}"), every=True)
    wait_for(
        lambda: all(status(d, j)["held"] for d in cluster for j in (garbled, unsigned)),
        15,
        "both running jobs held on every node",
    )

    def safe() -> None:
        assert_still_running(cluster, garbled, garbled_pids)
        assert_still_running(cluster, unsigned, unsigned_pids)
        lines = runs.read_text().splitlines()
        assert len(lines) == 1, f"the finished job ran again: {lines}"
        for daemon in cluster:
            doc = status(daemon, f_id)
            assert doc["state"] == "SUCCEEDED" and not doc["held"], (daemon.name, doc)
            assert worker_pids(doc) == worker_pids(finished), (
                daemon.name,
                doc["workers"],
            )  # no new run

    # "never": for 5 s after every daemon refused the three outcomes, the running jobs keep
    # their workers and the finished one does not run again
    observe(5.0, safe)
    figures.add(
        "C2: refusals of the unsigned/garbage outcomes (n1 / n2)",
        " / ".join(f"{c - b0:.0f}" for c, b0 in zip(refused_counts(cluster), before)),
    )

    # the owners' cancels replace the bad records
    cancel_and_check(cluster, n1, garbled, garbled_pids)
    cancel_and_check(cluster, n2, unsigned, unsigned_pids)
    # the finished job: cancel says it ended (from what the daemon saw), not a MAC error
    for daemon in cluster:
        error = daemon.ctl("cancel", f_id, expect=1)["error"]
        assert error["code"] == "conflict" and "already ended" in error["message"], error
        assert "MAC" not in error["message"] and "record" not in error["message"], error
    assert len(runs.read_text().splitlines()) == 1


# -- C12, C13: a job whose records a member refuses is held, on every node -----------------------

HELD = "elasticd_jobs_held"
JOB_RECORDS = ("jobs/spec/{}", "jobs/outcome/{}", "jobs/parts/{}", "rdzv/{}/state")


def copy_records(attacker: Attacker, suffixes: list[str], source: str, target: str) -> None:
    """Each of job ``source``'s records (``suffixes`` with "{}" for the job id) copied onto
    the same key of job ``target``."""
    for suffix in suffixes:
        raw = attacker.read(suffix.format(source))
        assert raw is not None, suffix.format(source)
        attacker.write(suffix.format(target), raw)


def held_and_idle(daemons: list[Daemon], job_id: str, why: str) -> list[str]:
    """What is wrong with the job on these daemons (nothing, once every one shows it held,
    naming ``why``, and not RUNNING: in `status` and in `list`, and counts it held)."""
    wrong = []
    for daemon in daemons:
        doc = status(daemon, job_id)
        listed = next(j for j in daemon.ctl("list", "--all") if j["id"] == job_id)
        if not (doc["held"] and why in doc["held"] and doc["state"] != "RUNNING"):
            wrong.append(f"{daemon.name}: {doc['state']} held={doc['held']!r}")
        elif listed["held"] != doc["held"] or listed["state"] != doc["state"]:
            wrong.append(f"{daemon.name} lists it {listed['state']} held={listed['held']!r}")
        elif metric(daemon, HELD) != 1:
            wrong.append(f"{daemon.name} counts {metric(daemon, HELD)} held jobs")
    return wrong


def assert_held_and_idle(cluster: Cluster, job_id: str, why: str) -> None:
    wrong = held_and_idle(list(cluster), job_id, why)
    assert not wrong, "; ".join(wrong)


def wait_held_and_idle(cluster: Cluster, job_id: str, why: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while wrong := held_and_idle(list(cluster), job_id, why):
        assert time.monotonic() < deadline, (
            f"{job_id} not held (naming {why!r}) and idle on every node within {timeout:g} s: {'; '.join(wrong)}"
        )
        time.sleep(0.25)


@pytest.mark.slow
@pytest.mark.parametrize("restart", ["SIGKILL", "SIGTERM"])
def test_c12_copied_records_and_a_restarted_member_hold_the_job_everywhere(
    cluster, shared_tmp, figures, restart
):
    n1, n2 = cluster.add("n1"), cluster.add("n2")
    cluster.start()
    attacker = Attacker(cluster)
    a = n1.submit_wait("--nnodes", "2", *worker_args())
    assert a["state"] == "SUCCEEDED", a
    b, pids = two_node_job(n1, shared_tmp)
    copy_records(
        attacker, [*JOB_RECORDS, *(f"jobs/part/{{}}/{d.name}" for d in cluster)], a["id"], b
    )
    if restart == "SIGKILL":
        n2.proc.kill()
        n2.proc.wait()
    else:
        n2.stop()
    n2.start()
    wait_for(
        lambda: refusal_logged(n2, attacker.key(f"jobs/outcome/{b}")),
        15,
        f"{n2.name} refused the copied outcome of {b}",
    )

    # the restarted member refuses B's outcome: it holds B, and every node shows it held and
    # why; nothing of B runs, and no node shows it RUNNING (n1 did, from n2's part before its
    # restart, for good)
    why = f"{n2.name}: its outcome record was refused"
    wait_held_and_idle(cluster, b, why)
    assert wait_gone(list(pids.values()), timeout=30) == [], f"{b}'s workers run on"
    observe(OBSERVE, lambda: assert_held_and_idle(cluster, b, why))
    figures.add(
        f"C12 ({restart}): the job's state on n1 / n2",
        " / ".join(status(d, b)["state"] for d in cluster),
    )

    # its owner's cancel ends it everywhere (it replaces the refused outcome)
    cancel_and_check(cluster, n1, b, pids)
    # the job gauges are recounted at most every 0.5 s after a change
    wait_for(lambda: all(metric(d, HELD) == 0 for d in cluster), 10, "no job counted held")


@pytest.mark.slow
def test_c13_a_rendezvous_state_no_member_can_restore_holds_the_job(cluster, shared_tmp, figures):
    n1, n2, n3 = cluster.add("n1"), cluster.add("n2"), cluster.add("n3")
    cluster.start()
    attacker = Attacker(cluster)
    a = n1.submit_wait("--nnodes", "2", *worker_args())
    assert a["state"] == "SUCCEEDED", a
    b, pids = two_node_job(
        n1, shared_tmp, "--nodes", f"{n2.name},{n3.name}"
    )  # not the store's host
    for daemon in (n2, n3):  # every member down: none keeps B's state in mind
        daemon.proc.kill()
        daemon.proc.wait()
    copy_records(attacker, ["rdzv/{}/state"], a["id"], b)
    for daemon in (n2, n3):
        daemon.start(wait=False)
    for daemon in (n2, n3):
        daemon.wait_notify("READY=1", 60)

    # each member refuses the state and never starts B afresh: held, on every node, not RUNNING
    wait_held_and_idle(cluster, b, "its rendezvous state")
    doc = status(n1, b)
    assert all(f"{d.name}: its rendezvous state" in doc["held"] for d in (n2, n3)), doc["held"]
    assert wait_gone(list(pids.values()), timeout=30) == [], f"{b}'s workers run on"
    observe(OBSERVE, lambda: assert_held_and_idle(cluster, b, "its rendezvous state"))
    assert attacker.read(f"rdzv/{b}/state") == attacker.read(
        f"rdzv/{a['id']}/state"
    )  # not started afresh
    figures.add("C13: held by", doc["held"])
    cancel_and_check(cluster, n2, b, pids)
