"""The control socket, sd_notify, metrics, config errors and users, against a real daemon."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import time
import urllib.request

import psutil
import pytest
from harness import PY, WORKER, Control, fake_nvidia_smi, free_port, worker_args

from elasticd.wire import protocol

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


@pytest.fixture
def metered(daemon_factory):
    port = free_port()
    daemon = daemon_factory(args=("--slots", "4"), metrics_port=port).start()
    daemon.metrics_url_port = port
    return daemon


def test_a_refusal_of_a_huge_request_is_one_short_line_in_the_daemon_log(daemon):
    """A client's text in a refusal (here a 1 MB op name with newlines) is cut short in the
    log: a user cannot flood the journal with megabyte records, nor forge lines."""
    with Control(daemon.socket) as control:
        reply = control.call("j-1a2b3c\nforged line " + "x" * 1_000_000, {})
        assert not reply.ok and reply.code == "unknown_op", reply
        assert control.call("version", {}).ok
    lines = [line for line in daemon.log_text().splitlines() if "refused: unknown_op" in line]
    assert lines and all(len(line) < 800 for line in lines), [len(line) for line in lines]
    assert not any(line.startswith("forged line") for line in daemon.log_text().splitlines())


@pytest.mark.parametrize(
    "frame, code",
    [
        (b"{not json", "bad_request"),
        (b"[1, 2]", "bad_request"),
        (
            json.dumps({"v": 1, "id": "x1", "op": "launch_missiles", "args": {}}).encode(),
            "unknown_op",
        ),
        (
            json.dumps({"v": 1, "id": "x2", "op": "status", "args": {"job": 7}}).encode(),
            "bad_request",
        ),
        (json.dumps({"v": 1, "id": "x3", "op": "status", "args": {}}).encode(), "bad_request"),
        (
            json.dumps({"v": 1, "id": "x4", "op": "submit", "args": {"argv": "a.py"}}).encode(),
            "bad_request",
        ),
        (json.dumps({"v": 2, "id": "x5", "op": "version"}).encode(), "bad_request"),
        (
            json.dumps({"v": 1, "id": "x6", "op": "status", "args": {"job": "j-nope"}}).encode(),
            "not_found",
        ),
        (
            json.dumps(
                {"v": 1, "id": "x7", "op": "submit", "args": {"argv": ["a.py"], "nnodes": "3:1"}}
            ).encode(),
            "invalid_spec",
        ),
    ],
)
def test_malformed_requests_get_an_error_reply(metered, frame, code):
    with Control(metered.socket) as control:
        control.send_raw(frame)
        reply = control.recv()
        assert not reply.ok and reply.code == code, reply
        assert control.call("version", {}).ok  # the same connection goes on working
    text = _metrics(metered.metrics_url_port)
    assert f'result="{code}"' in text


def test_a_zero_join_timeout_is_refused_at_submit_and_later_jobs_still_run(metered):
    """What the rendezvous cannot take is refused at submit, never left to stall placement."""
    reply = metered.request(
        "submit", argv=[str(WORKER)], python=PY, workdir=str(metered.base), join_timeout=0
    )
    assert (reply.ok, reply.code) == (False, "invalid_spec") and "join_timeout" in reply.message
    job = metered.submit(*worker_args())
    assert metered.wait_job(job["id"], lambda d: d["state"] == "SUCCEEDED")


def test_a_job_no_node_could_ever_run_is_refused_at_submit(metered):
    """Slurm's "Requested node configuration is not available": no PENDING forever."""
    for args, words in (
        (("--nproc-per-node", "5"), "no node can run 5 workers on its own: n1 has 4 slots"),
        (("--nproc-per-node", "gpu"), "one worker per GPU"),
        (("--nodes", "elsewhere"), "no node named elsewhere"),
    ):
        done = metered.ctl_run("submit", *args, *worker_args())
        assert done.returncode == 1 and words in done.stderr, done.stderr
    assert metered.ctl("list", "--all") == []
    assert metered.submit("--nproc-per-node", "4", *worker_args())["state"] == "PENDING"


def test_oversized_frame_is_refused_with_its_id(metered):
    big = protocol.encode_request(protocol.Request("big-1", "status", {"job": "x" * (5 << 20)}))
    with Control(metered.socket) as control:
        control.send_raw(big)
        reply = control.recv()
        assert (reply.ok, reply.code, reply.id) == (False, "too_large", "big-1")
        assert control.call("version", {}).ok


def test_client_gone_mid_stream_does_not_hurt_the_daemon(metered):
    job = metered.submit(*worker_args("--sleep", "0", "--print", "1"))
    control = Control(metered.socket)
    stream = control.stream("logs", {"job": job["id"], "follow": True}, timeout=30)
    next(stream)  # the stream is open
    control.close()  # and the client disappears
    metered.ctl("cancel", job["id"])  # the job's end makes the daemon write to the gone client
    assert metered.request("version").ok
    assert metered.proc.poll() is None


def test_sd_notify_ready_status_watchdog_stopping(daemon_factory):
    daemon = daemon_factory(env={"WATCHDOG_USEC": "200000"}).start()
    ready = daemon.messages.index("READY=1")
    assert any(m.startswith("STATUS=") for m in daemon.messages[:ready])  # a status line by then
    assert daemon.wait_notify("WATCHDOG=1", timeout=5)
    job = daemon.submit("--nproc-per-node", "2", *worker_args("--sleep", "0"))
    daemon.wait_running(job["id"], 2)
    assert daemon.wait_notify("STATUS=1 job running, 2 workers", timeout=10)
    daemon.signal(signal.SIGTERM)
    daemon.wait_notify("STOPPING=1")
    assert daemon.wait_exit() == 0


def test_metrics_endpoint(metered):
    metered.submit_wait(*worker_args())
    needles = (
        'elasticd_jobs{state="SUCCEEDED"} 1.0',
        'elasticd_workers{state="HEALTHY"} 0.0',
        'elasticd_worker_exits_total{exit_code="0"} 1.0',
        "elasticd_worker_restarts_total 0.0",
        'elasticd_control_requests_total{op="submit",result="ok"} 1.0',
        'elasticd_build_info{version="',
        "process_resident_memory_bytes",
        "elasticd_store_up 1.0",
    )
    # the job gauges are recounted at most every 0.5 s after a change: a scrape just after
    # the job ended may come before it
    deadline = time.monotonic() + 10
    while missing := [n for n in needles if n not in _metrics(metered.metrics_url_port)]:
        assert time.monotonic() < deadline, missing
        time.sleep(0.1)


def test_bad_config_key_stops_start_up_naming_it(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[node]\nslotz = 3\n")
    done = subprocess.run(
        [PY, "-m", "elasticd", "--config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "node.slotz" in done.stderr and "unknown key" in done.stderr


def test_a_runtime_dir_that_others_can_write_is_refused(tmp_path):
    """Somebody who made /tmp/elasticd-UID first could swap the control socket."""
    runtime = tmp_path / "run"
    runtime.mkdir()
    runtime.chmod(0o777)
    done = subprocess.run(
        [
            PY,
            "-m",
            "elasticd",
            "--standalone",
            "--state-dir",
            str(tmp_path / "state"),
            "--runtime-dir",
            str(runtime),
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and f"refusing {runtime}" in done.stderr, done.stderr
    assert not (runtime / "control.sock").exists()


def test_a_metrics_port_in_use_stops_start_up_naming_the_key(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                PY,
                "-m",
                "elasticd",
                "--standalone",
                "--state-dir",
                str(tmp_path / "s"),
                "--runtime-dir",
                str(tmp_path / "r"),
                "--metrics-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"config key 'metrics.port': cannot listen on 0.0.0.0:{port}" in done.stderr
    assert not (tmp_path / "r" / "control.sock").exists()


def test_second_daemon_on_the_same_socket_is_refused(daemon, daemon_factory):
    twin = daemon_factory(name="n1")
    twin.state_dir = daemon.state_dir.parent / "twin-state"
    done = subprocess.run(
        [
            PY,
            "-m",
            "elasticd",
            "--standalone",
            "--state-dir",
            str(twin.state_dir),
            "--runtime-dir",
            str(daemon.runtime_dir),
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "already serving" in done.stderr
    assert daemon.request("version").ok


def test_elasticctl_without_a_daemon(tmp_path):
    done = subprocess.run(  # its timeout is the bound: under the client's 15 s request timeout
        [PY, "-m", "elasticctl", "--socket", str(tmp_path / "none.sock"), "list"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert done.returncode == 2
    assert f"elasticd is not running (no control socket at {tmp_path / 'none.sock'})" in done.stderr


def test_fake_nvidia_smi_gpus_are_partitioned(daemon_factory, shared_tmp):
    daemon = daemon_factory(
        args=("--slots", "8"), env=fake_nvidia_smi(shared_tmp / "bin", 4)
    ).start()
    out = shared_tmp / "env"
    out.mkdir()
    daemon.submit_wait("--nproc-per-node", "gpu", *worker_args("--env-out", str(out)))
    envs = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(4)]
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {"0,1,2,3"}
    assert sorted(e["LOCAL_RANK"] for e in envs) == ["0", "1", "2", "3"]
    nodes = daemon.ctl("nodes")
    assert nodes[0]["gpus_total"] == 4 and nodes[0]["slots_total"] == 8


@needs_root
def test_jobs_run_as_the_submitter_and_others_cannot_cancel(daemon, shared_tmp):
    nobody = pwd.getpwnam("nobody")
    pids_dir = shared_tmp / "pids"
    pids_dir.mkdir()
    pids_dir.chmod(0o777)
    job = daemon.ctl(
        "submit",
        *worker_args("--sleep", "0", "--pid-dir", str(pids_dir)),
        user="nobody",
        cwd=str(shared_tmp),
    )
    assert job["user"] == "nobody"
    daemon.wait_output(job["id"], ["ready 0"])
    worker = psutil.Process(int((pids_dir / "rank_0.pid").read_text().split()[0]))
    assert worker.uids().real == nobody.pw_uid and worker.gids().real == nobody.pw_gid
    log_dir = daemon.state_dir / "logs" / job["id"] / "attempt_0"
    out = os.stat(
        log_dir / "rank_0.out"
    )  # the daemon's: the job reads it (an ACL), cannot write it
    assert (out.st_uid, out.st_gid, out.st_mode & 0o777) == (0, 0, 0o640)
    appended = subprocess.run(
        ["runuser", "-u", "nobody", "--", "sh", "-c", f"echo more >> {log_dir / 'rank_0.out'}"],
        capture_output=True,
    )
    assert appended.returncode != 0 and b"denied" in appended.stderr
    assert (
        subprocess.run(
            ["runuser", "-u", "nobody", "--", "cat", str(log_dir / "rank_0.out")],
            capture_output=True,
        ).returncode
        == 0
    )

    root_job = daemon.submit(*worker_args("--sleep", "0"))
    refused = daemon.ctl_run("cancel", root_job["id"], user="nobody")
    assert refused.returncode == 1 and "you may not cancel" in refused.stderr
    assert daemon.ctl("status", root_job["id"])["state"] in ("RENDEZVOUS", "RUNNING")
    assert daemon.ctl_run("logs", root_job["id"], user="nobody").returncode == 1
    assert daemon.ctl("cancel", job["id"], user="nobody")["state"] == "CANCELLED"
    assert daemon.ctl("cancel", root_job["id"])["state"] == "CANCELLED"  # root cancels any


_PLANTER = """
import json, os, sys
error_file = os.environ["TORCHELASTIC_ERROR_FILE"]
attempt_dir = os.path.dirname(error_file)
job_dir = os.path.dirname(attempt_dir)
target, mode = sys.argv[1], sys.argv[2]
if mode == "fail":  # what torch's @record does: write the error file, then exit non-zero
    with open(error_file, "w") as f:
        json.dump({"message": {"message": "planted root cause", "extraInfo": {}}}, f)
    sys.exit(3)
tries = {"next attempt": lambda: os.symlink(target, os.path.join(job_dir, "attempt_1")),
         "own attempt": lambda: os.symlink(target, os.path.join(attempt_dir, "rank_9.out"))}
for what, plant in tries.items():
    try:
        plant()
        print(what, "planted", flush=True)
    except OSError as exc:
        print(what, "refused", type(exc).__name__, flush=True)
sys.exit(1 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" else 0)
"""


@needs_root
def test_a_job_cannot_make_the_daemon_write_or_read_through_its_symlinks(daemon, shared_tmp):
    """Log and error-file directories stay the daemon's, and so do the output files; the
    user owns only its error file (torch's @record in the worker writes it) until the worker
    exits and the daemon keeps its own copy."""
    target = shared_tmp / "precious"
    target.write_text("root's own\n")
    target.chmod(0o600)
    script = shared_tmp / "planter.py"
    script.write_text(_PLANTER)
    script.chmod(0o644)
    job = daemon.ctl(
        "submit",
        "--wait",
        "--max-restarts",
        "1",
        str(script),
        str(target),
        "plant",
        user="nobody",
        cwd=str(shared_tmp),
    )[-1]
    assert job["state"] == "SUCCEEDED" and job["restarts"] == 1, job
    logs = daemon.ctl_run("logs", job["id"]).stdout
    assert "planted" not in logs and logs.count(" refused ") == 4, logs
    assert target.read_text() == "root's own\n" and target.stat().st_uid == 0
    attempt = daemon.state_dir / "logs" / job["id"] / "attempt_1"
    assert attempt.stat().st_uid == 0 and attempt.parent.stat().st_uid == 0
    assert (attempt / "rank_0.out").stat().st_uid == 0  # its output files are the daemon's
    assert (attempt / "rank_0.error.json").stat().st_uid == 0  # the daemon's copy, from the exit

    failed = daemon.ctl(
        "submit",
        "--wait",
        str(script),
        str(target),
        "fail",
        user="nobody",
        cwd=str(shared_tmp),
        expect=1,
    )[-1]
    assert failed["error"]["message"] == "planted root cause", failed


@needs_root
def test_root_jobs_refused_unless_allowed(daemon_factory, shared_tmp):
    config = shared_tmp / "c.toml"
    config.write_text("[jobs]\nallow_root = false\n")
    daemon = daemon_factory(args=("--config", str(config), "--slots", "2"), standalone=True).start()
    # --standalone allows root jobs unless the config says otherwise
    done = daemon.ctl_run("submit", *worker_args())
    assert done.returncode == 1 and "allow_root" in done.stderr


@pytest.mark.parametrize(
    "args",
    [
        {"nnodes": "1_0:2_0"},  # int() made it 10:20
        {"nnodes": "\u0661:\u0662"},  # Arabic-Indic digits: int() made it 1:2
        {"nnodes": "\uff11"},  # a fullwidth digit
        {"nproc_per_node": "\u0662"},
        {"nproc_per_node": "1_0"},
    ],
)
def test_a_raw_submit_with_numbers_that_are_not_ascii_digits_is_refused(metered, args):
    """Read as digits 0-9 only (wire/numbers.py): refused, no job made, the daemon goes on."""
    reply = metered.request(
        "submit", argv=[str(WORKER)], python=PY, workdir=str(metered.base), **args
    )
    assert (reply.ok, reply.code) == (False, "invalid_spec"), reply
    assert "digits 0-9" in reply.message or "positive integer" in reply.message, reply.message
    assert metered.ctl("list", "--all") == []
    assert metered.request("version").ok


@pytest.mark.parametrize(
    "args",
    [
        {"since": -6.048e19},  # `--since 99999999999999w`, sent by an elasticctl of before
        {"since": -2.592e14},  # `--since 3000000000d`: "usage from -8211695-11-21"
        {"until": 1e300},
        {"since": 1.0, "until": 2.6e11},
    ],
)
def test_a_usage_request_out_of_the_calendar_is_refused(metered, args):
    reply = metered.request("usage", **args)
    assert (reply.ok, reply.code) == (False, "bad_request"), reply
    assert "between 1970-01-01 and 9999-12-31" in reply.message
    assert metered.request("usage", since=0.0).ok
