"""A local user (nobody) against the control socket: thousands of idle connections, a flood of
requests it never reads, a log stream it never reads, and requests no valid client sends
(docs/security.md, "Who calls, and how much one caller may ask").  The daemon stays up, keeps answering everyone else, and its
memory and descriptors stay bounded."""

from __future__ import annotations

import json
import os
import pwd
import select
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness import (
    FIXTURES,
    PY,
    Control,
    needs_root,
    python_for_everyone,
    sleeping_job,
    worker_args,
)

FLOOD = FIXTURES / "flood.py"
MiB = 1 << 20


class Attacker:
    """flood.py run as nobody; holds its attack until stopped."""

    def __init__(self, socket_path: str, mode: str, arg: str) -> None:
        nobody = pwd.getpwnam("nobody")
        self.proc = subprocess.Popen(
            ["/usr/bin/python3", str(FLOOD), socket_path, mode, arg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            user=nobody.pw_uid,
            group=nobody.pw_gid,
            extra_groups=[],
            cwd="/",
        )

    def ready(self, timeout: float = 120.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert readable, f"the attacker was not ready within {timeout} s"
        line = self.proc.stdout.readline()
        assert line, f"the attacker ended with {self.proc.wait(timeout)}"
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def attackers():
    started: list[Attacker] = []

    def start(*args: str) -> Attacker:
        started.append(Attacker(*args))
        return started[-1]

    yield start
    for attacker in started:
        attacker.stop()


def timed_status(daemon, job_id: str) -> float:
    """Seconds for root's `elasticctl status` (a fresh process) while the attack goes on."""
    started = time.monotonic()
    assert daemon.ctl("status", job_id)["id"] == job_id
    return time.monotonic() - started


def rss(daemon) -> int:
    return psutil.Process(daemon.proc.pid).memory_info().rss


@needs_root
def test_thousands_of_idle_connections_cannot_take_the_daemon_down(
    daemon, shared_tmp, attackers, figures
):
    job_id, pids = sleeping_job(daemon, shared_tmp, 1)
    daemon_proc = psutil.Process(daemon.proc.pid)
    fds_before = daemon_proc.num_fds()
    floods = [attackers(daemon.socket, "idle", "10000") for _ in range(2)]
    reports = [flood.ready() for flood in floods]
    fds_during = daemon_proc.num_fds()
    latency = timed_status(daemon, job_id)
    held = sum(r["connected"] for r in reports)
    refused = sum(r["told_refused"] for r in reports)
    figures.add("item 1: idle connections opened by nobody (2 processes)", f"{held}")
    figures.add("item 1: of them refused and closed by the daemon", f"{refused}")
    figures.add("item 1: daemon fds before / during the attack", f"{fds_before} / {fds_during}")
    figures.add("item 1: root's `elasticctl status` during the attack", f"{latency * 1000:.0f} ms")
    # The daemon keeps IDLE_KEPT of the user's connections, whichever process opened them.
    # Each flood stops waiting once at most IDLE_KEPT of its own are unanswered (kept, or
    # still in the accept queue), so up to twice that may be uncounted; the daemon's fds
    # below are the exact bound.
    assert held == 20000 and refused >= held - 2 * 32  # flood.py IDLE_KEPT, per process
    assert fds_during <= fds_before + 32
    assert daemon.proc.poll() is None and all(psutil.pid_exists(p) for p in pids)
    metrics_refused = daemon.request("version").ok  # and the control socket still answers
    assert metrics_refused
    for flood in floods:
        flood.stop()
    assert daemon.ctl("cancel", job_id)["state"] == "CANCELLED"


@needs_root
def test_a_flood_of_requests_that_are_never_read_stalls_and_bloats_nothing(
    daemon, shared_tmp, attackers, figures
):
    job_id, _ = sleeping_job(daemon, shared_tmp, 1)
    before = rss(daemon)
    floods = [attackers(daemon.socket, "requests", "100000") for _ in range(8)]
    sent = [flood.ready()["sent"] for flood in floods]
    latency = timed_status(daemon, job_id)
    grown = rss(daemon) - before
    figures.add(
        "item 2: `list` requests sent without reading (8 connections x 100,000 tried)",
        f"{sum(sent)} taken before the daemon stopped reading",
    )
    figures.add("item 2: daemon RSS growth under never-reading clients", f"{grown / MiB:.1f} MiB")
    figures.add("item 2: root's `elasticctl status` during the flood", f"{latency * 1000:.0f} ms")
    assert all(s < 100000 for s in sent)  # the daemon stopped reading them: backpressure
    assert grown < 64 * MiB
    for flood in floods:
        flood.stop()
    assert daemon.ctl("cancel", job_id)["state"] == "CANCELLED"


@needs_root
def test_a_user_hammering_the_socket_does_not_starve_the_others(
    daemon, shared_tmp, attackers, figures
):
    """nobody sends `list` as fast as the daemon answers, on 8 connections; root's requests
    meanwhile wait behind at most a few of nobody's (a user has 4 being worked on at a time)."""
    job_id, _ = sleeping_job(daemon, shared_tmp, 1)
    for _ in range(20):  # a list worth computing: jobs queued behind the sleeper for slots
        daemon.submit("--nproc-per-node", "4", *worker_args())
    hammer = attackers(daemon.socket, "hammer", "6")
    latencies = []
    with Control(daemon.socket) as control:
        started = time.monotonic()
        while time.monotonic() - started < 4:
            sent = time.monotonic()
            assert control.call("status", {"job": job_id}).ok
            latencies.append(time.monotonic() - sent)
    report = hammer.ready(timeout=30)
    latencies.sort()
    figures.add(
        "item 1: requests/s served to a user hammering on 8 connections", f"{report['per_second']}"
    )
    figures.add(
        "item 1: another user's `status` meanwhile, median / max",
        f"{latencies[len(latencies) // 2] * 1000:.1f} / {latencies[-1] * 1000:.1f} ms",
    )
    assert report["requests"] > 0 and "error" not in report  # and every call above was answered


@needs_root
def test_a_log_follower_that_never_reads_holds_none_of_the_output(
    daemon, shared_tmp, attackers, figures
):
    """The job (nobody's own) writes 1 GiB; its owner follows the logs and never reads."""
    go = shared_tmp / "go"
    os.mkfifo(go)
    os.chmod(go, 0o666)
    job = daemon.ctl(
        "submit",
        "--python",
        f"{python_for_everyone()}/bin/python3",
        *worker_args("--wait-for", str(go), "--spew", "1024"),
        user="nobody",
    )
    daemon.wait_running(job["id"], 1)
    follower = attackers(daemon.socket, "follow", job["id"])
    follower.ready()
    peak_before = peak_rss(daemon)
    started = time.monotonic()
    with open(go, "wb"):
        pass  # the worker starts writing
    done = daemon.wait_job(job["id"], lambda d: d["state"] in ("SUCCEEDED", "FAILED"), timeout=300)
    seconds = time.monotonic() - started
    grown = peak_rss(daemon) - peak_before
    logs = daemon.state_dir / "logs" / job["id"] / "attempt_0"  # rotated (output.max_bytes)
    kept = sum(p.stat().st_size for p in logs.glob("rank_0.out*") if p.suffix != ".rotated")
    written = kept + int((logs / "rank_0.out.rotated").read_text().split()[1])  # + rotated away
    figures.add(
        "item 2: 1 GiB of output, follower never reads: daemon peak RSS growth",
        f"{grown / MiB:.1f} MiB ({written / MiB:.0f} MiB written in {seconds:.1f} s, "
        f"{kept / MiB:.0f} MiB of it kept on disk)",
    )
    assert done["state"] == "SUCCEEDED" and written == 1 << 30  # the worker never blocked
    assert kept <= 4 * 100 * MiB  # output.max_bytes x (output.backups + 1), the defaults
    assert grown < 64 * MiB
    follower.stop()
    assert daemon.request("version").ok


def peak_rss(daemon) -> int:
    """The daemon's peak resident set since it started (VmHWM), in bytes."""
    status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
    return (
        int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
        * 1024
    )


def test_requests_no_valid_client_sends_get_clear_errors_and_list_survives(daemon, figures):
    """Lone surrogates, non-finite numbers and NUL bytes are refused where they enter; and
    `list` works for everyone afterwards (one bad job name used to break it for all)."""
    cases = [
        (
            b'{"v":1,"id":"a1","op":"submit","args":{"argv":["x.py"],"name":"evil\\ud800"}}',
            "bad_request",
        ),
        (
            b'{"v":1,"id":"a2","op":"submit","args":{"argv":["x.py"],"join_timeout":Infinity}}',
            "bad_request",
        ),
        (
            b'{"v":1,"id":"a3","op":"submit","args":{"argv":["x.py"],"join_timeout":1e309}}',
            "bad_request",
        ),
        (
            b'{"v":1,"id":"a4","op":"submit","args":{"argv":["x.py"],"join_timeout":NaN}}',
            "bad_request",
        ),
        (b'{"v":1,"id":"\\udc80","op":"list","args":{}}', "bad_request"),
    ]
    with Control(daemon.socket) as control:
        for raw, code in cases:
            control.send_raw(raw)
            reply = control.recv()
            assert (reply.ok, reply.code) == (False, code), (raw, reply)
        env_nul = control.call(
            "submit",
            {
                "argv": [str(worker_args()[0])],
                "python": PY,
                "workdir": str(daemon.base),
                "env": {"A\x00B": "1"},
            },
        )
        assert (env_nul.ok, env_nul.code) == (False, "invalid_spec") and "env" in env_nul.message
        argv_nul = control.call(
            "submit",
            {"argv": [str(worker_args()[0]), "a\x00b"], "python": PY, "workdir": str(daemon.base)},
        )
        assert (argv_nul.ok, argv_nul.code) == (False, "invalid_spec")
        huge = control.call(
            "submit",
            {
                "argv": [str(worker_args()[0])],
                "python": PY,
                "workdir": str(daemon.base),
                "exit_barrier_timeout": 1e300,
            },
        )
        assert (huge.ok, huge.code) == (False, "invalid_spec")
        assert control.call("list", {"all": True}).ok
    assert daemon.ctl("list", "--all") == []
    assert daemon.proc.poll() is None


def test_a_flood_of_bad_requests_is_logged_once_per_interval(daemon, figures):
    """Each refused request was an INFO line in the daemon's log, so a local user could write
    the journal at the rate it sent junk: refusals are counted, every one, and logged once
    per kind and log.summary_interval with how many more there were."""
    before = daemon.log_path.read_text().count(" refused: ")
    with Control(daemon.socket) as control:
        for n in range(3000):
            control.send_raw(b'{"v":1,"id":"x%d","op":"launch_missiles","args":{}}' % n)
            assert control.recv().code == "unknown_op"
            control.send_raw(b"{not json")
            assert control.recv().code == "bad_request"
        assert control.call("version", {}).ok
    lines = daemon.log_path.read_text().count(" refused: ") - before
    figures.add("audit: log lines for 6,000 refused requests", f"{lines}")
    assert lines <= 2  # one per kind: unknown_op, bad_request
    assert daemon.proc.poll() is None
