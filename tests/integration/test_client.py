"""elasticctl against a stand-in daemon written here: a Unix stream socket speaking the
control protocol's frames.

The stand-in answers each request from a script (op -> replies), so these tests pin the
client's side of the wire: unary replies, streams ending at ``end``, error replies, no reply
at all, a daemon that hangs up, and no daemon.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
from harness import with_sigint

from elasticctl import cli
from elasticd import __version__
from elasticd.wire import paths, protocol

Answer = Callable[[protocol.Request], list[bytes]]
HANG_UP = b"hang up"  # not a reply: the stand-in closes the connection instead
# seconds within which "not running" must be reported, a fresh interpreter's start included:
# under the client's 15 s request timeout, which a wait or a retry would run into; a bound for
# a loaded machine (2 s was once tight there), not an expectation
QUICK = 10.0
EXIT_BOUND = 15.0  # an interrupted elasticctl's exit: immediate, bounded for a loaded machine


class StandIn:
    """A listening Unix socket whose thread answers each request with ``answer``."""

    def __init__(self, path: str, answer: Answer) -> None:
        self.path = path
        self.requests: list[protocol.Request] = []
        self._answer = answer
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen()
        self._connections: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # stopped
            self._connections.append(conn)
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        frames = protocol.FrameReader(protocol.MAX_FRAME)
        try:
            while data := conn.recv(1 << 16):
                for frame in frames.feed(data):
                    request = protocol.decode_request(frame)
                    self.requests.append(request)
                    for reply in self._answer(request):
                        if reply == HANG_UP:
                            conn.close()
                            return
                        conn.sendall(protocol.framed(reply))
        except OSError:
            pass

    def stop(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in self._connections:
            conn.close()
        self._thread.join()


@pytest.fixture
def sock_path(tmp_path, monkeypatch):
    """The stand-in's socket; the tests run in a directory with a train.py to submit."""
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    return str(tmp_path / "control.sock")


@pytest.fixture
def daemon(sock_path):
    """daemon(answer) -> a running stand-in; stopped after the test."""
    started: list[StandIn] = []

    def start(answer: Answer) -> StandIn:
        started.append(StandIn(sock_path, answer))
        return started[-1]

    yield start
    for stand_in in started:
        stand_in.stop()


def run(sock_path, *argv):
    return cli.main(["--socket", sock_path, *argv])


def job_doc(state, **extra):
    return {
        "id": "j-7f3a21",
        "state": state,
        "nnodes": "1:1",
        "restarts": 0,
        "max_restarts": 1,
        "round": 0,
        "world_size": 2,
        "workers": [],
        "error": None,
        "barrier": None,
        **extra,
    }


# -- unary ----------------------------------------------------------------------------------


def test_version_from_client_and_daemon(daemon, sock_path, capsys):
    stand_in = daemon(lambda req: [protocol.ok(req.id, {"version": "9.9", "node": "n1"})])
    assert run(sock_path, "version") == 0
    assert capsys.readouterr().out == f"elasticctl {__version__}\nelasticd 9.9 on node n1\n"
    assert [(r.op, r.args) for r in stand_in.requests] == [("version", {})]
    assert len(stand_in.requests[0].id) == 32  # a uuid4 in hex


def test_version_json(daemon, sock_path, capsys):
    daemon(lambda req: [protocol.ok(req.id, {"version": "9.9", "node": "n1"})])
    assert run(sock_path, "--json", "version") == 0
    assert json.loads(capsys.readouterr().out) == {
        "elasticctl": __version__,
        "elasticd": {"version": "9.9", "node": "n1"},
    }


def test_replies_to_other_requests_are_ignored(daemon, sock_path, capsys):
    daemon(
        lambda req: [
            protocol.ok("someone-else", {"version": "0", "node": "x"}),
            protocol.ok(req.id, {"version": "9.9", "node": "n1"}),
        ]
    )
    assert run(sock_path, "version") == 0
    assert "elasticd 9.9 on node n1" in capsys.readouterr().out


def listed(req, *batches):
    """The `list` stream: a reply per batch of rows, then the end."""
    return [protocol.ok(req.id, {"jobs": rows}) for rows in batches] + [protocol.end(req.id)]


def test_list_sends_all_and_renders_one_table_of_every_batch(daemon, sock_path, capsys):
    stand_in = daemon(
        lambda req: listed(
            req, [job_doc("RUNNING", name="demo")], [job_doc("PENDING", id="j-000002", name="next")]
        )
    )
    assert run(sock_path, "ps", "--all") == 0
    assert stand_in.requests[0].args == {"all": True}
    header, row, second = capsys.readouterr().out.splitlines()
    assert header.split() == [
        "ID",
        "NAME",
        "USER",
        "STATE",
        "NODES",
        "ALLOC",
        "WORKERS",
        "RESTARTS",
        "AGE/ENDED",
    ]
    assert row.split()[:4] == ["j-7f3a21", "demo", "-", "RUNNING"]
    assert second.split()[:4] == ["j-000002", "next", "-", "PENDING"]


def test_list_json_is_one_list_of_every_batch(daemon, sock_path, capsys):
    rows = [job_doc("RUNNING"), job_doc("PENDING", id="j-000002")]
    daemon(lambda req: listed(req, rows[:1], rows[1:], []))
    assert run(sock_path, "list", "--json") == 0
    assert json.loads(capsys.readouterr().out) == rows


def test_list_from_a_daemon_that_answers_in_one_reply(daemon, sock_path, capsys):
    """A daemon from before the `list` stream sends every job in one reply, with no end."""
    daemon(lambda req: [protocol.ok(req.id, [job_doc("RUNNING")])])
    assert run(sock_path, "list", "--json") == 0
    assert json.loads(capsys.readouterr().out) == [job_doc("RUNNING")]


@pytest.mark.parametrize(
    "argv,op,args",
    [
        (["status", "j-7f3a21"], "status", {"job": "j-7f3a21"}),
        (["cancel", "j-7f"], "cancel", {"job": "j-7f"}),
        (["nodes"], "nodes", {}),
        (["drain", "n1"], "drain", {"node": "n1"}),
        (["undrain", "n1"], "undrain", {"node": "n1"}),
    ],
)
def test_json_prints_the_result_document(daemon, sock_path, capsys, argv, op, args):
    result = [{"name": "n1"}] if op == "nodes" else job_doc("CANCELLED")
    stand_in = daemon(lambda req: [protocol.ok(req.id, result)])
    assert run(sock_path, *argv, "--json") == 0
    assert json.loads(capsys.readouterr().out) == result
    assert [(r.op, r.args) for r in stand_in.requests] == [(op, args)]


def test_cancel_prints_the_job(daemon, sock_path, capsys):
    daemon(lambda req: [protocol.ok(req.id, job_doc("CANCELLED"))])
    assert run(sock_path, "cancel", "j-7f") == 0
    assert capsys.readouterr().out == "job j-7f3a21 cancelled\n"


def test_submit_sends_the_job_and_prints_its_id(daemon, sock_path, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MARKER", "from-submitter")
    stand_in = daemon(lambda req: [protocol.ok(req.id, job_doc("PENDING", nnodes="2:4"))])
    assert run(sock_path, "submit", "--nnodes", "2:4", "--env", "X=1", "train.py", "--lr", "1") == 0
    assert capsys.readouterr().out == "job j-7f3a21 submitted (waiting for 2..4 nodes)\n"
    args = stand_in.requests[0].args
    assert args["argv"] == ["train.py", "--lr", "1"] and args["kind"] == "script"
    assert args["workdir"] == str(tmp_path) and args["nnodes"] == "2:4"
    assert args["env"]["MARKER"] == "from-submitter" and args["env"]["X"] == "1"
    assert os.path.isabs(args["python"]) and "wait" not in args


# -- errors ---------------------------------------------------------------------------------


def test_error_reply_exits_1_with_the_message(daemon, sock_path, capsys):
    daemon(lambda req: [protocol.error(req.id, protocol.E_NOT_FOUND, "no job 'j-x'")])
    assert run(sock_path, "status", "j-x") == 1
    assert capsys.readouterr().err == "elasticctl: no job 'j-x'\n"


def test_error_reply_as_json(daemon, sock_path, capsys):
    daemon(lambda req: [protocol.error(req.id, protocol.E_PERMISSION, "not yours")])
    assert run(sock_path, "--json", "cancel", "j-1") == 1
    out = capsys.readouterr().out
    assert json.loads(out) == {"error": {"code": "permission_denied", "message": "not yours"}}


def test_oversized_request_is_refused_before_sending(daemon, sock_path, capsys):
    stand_in = daemon(lambda req: [protocol.ok(req.id, job_doc("PENDING"))])
    huge = "x" * protocol.MAX_FRAME
    assert run(sock_path, "submit", "--env", f"BIG={huge}", "train.py") == 1
    assert f"over the {protocol.MAX_FRAME}-byte limit" in capsys.readouterr().err
    assert stand_in.requests == []


def test_no_reply_times_out(daemon, sock_path, capsys, monkeypatch):
    monkeypatch.setenv("ELASTICCTL_TIMEOUT", "0.3")
    daemon(lambda req: [])
    started = time.monotonic()
    assert run(sock_path, "status", "j-1") == 2
    assert time.monotonic() - started < QUICK
    assert "elasticd did not answer within 0.3 s" in capsys.readouterr().err


def test_no_first_stream_reply_times_out(daemon, sock_path, capsys, monkeypatch):
    monkeypatch.setenv("ELASTICCTL_TIMEOUT", "0.3")
    daemon(lambda req: [])
    assert run(sock_path, "logs", "-f", "j-1") == 2
    assert "did not answer within 0.3 s" in capsys.readouterr().err


def test_daemon_hanging_up_is_reported_at_once(daemon, sock_path, capsys, monkeypatch):
    monkeypatch.setenv("ELASTICCTL_TIMEOUT", "30")
    daemon(lambda req: [HANG_UP])
    started = time.monotonic()
    assert run(sock_path, "status", "j-1") == 2
    assert time.monotonic() - started < QUICK
    assert "lost the connection to elasticd" in capsys.readouterr().err


def test_a_refused_connection_shows_why(daemon, sock_path, capsys):
    """A daemon over its connection limits says so before it hangs up (no request id)."""
    daemon(
        lambda req: [
            protocol.error("", protocol.E_TOO_MANY, "too many connections from uid 0"),
            HANG_UP,
        ]
    )
    assert run(sock_path, "status", "j-1") == 1
    assert capsys.readouterr().err == "elasticctl: too many connections from uid 0\n"


def test_an_argument_that_is_not_utf8_is_refused_by_the_client(daemon, sock_path, capsys):
    stand_in = daemon(lambda req: [protocol.ok(req.id, job_doc("PENDING"))])
    name = b"bad\xff".decode(errors="surrogateescape")  # as Python decodes such an argv
    assert run(sock_path, "submit", "--name", name, "train.py") == 1
    assert "not UTF-8" in capsys.readouterr().err and stand_in.requests == []


def test_daemon_hanging_up_mid_stream(daemon, sock_path, capsys):
    line = {"rank": 0, "stream": "out", "attempt": 0, "node": "n1", "text": "hello"}
    daemon(lambda req: [protocol.ok(req.id, {"lines": [line]}), HANG_UP])
    assert run(sock_path, "logs", "-f", "j-1") == 2
    captured = capsys.readouterr()
    assert captured.out == "[rank 0] hello\n"
    assert "lost the connection" in captured.err


# -- not running ----------------------------------------------------------------------------


def elasticctl(*argv, env=None):
    """Run the real command line in a subprocess; (returncode, stdout, stderr, seconds)."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "elasticctl", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - started


def test_missing_socket_exits_2_quickly(sock_path):
    code, out, err, seconds = elasticctl("--socket", sock_path, "list")
    assert (code, out) == (2, "")
    assert (
        err
        == f"elasticd is not running (no control socket at {sock_path}); {paths.REACH_ELSEWHERE}\n"
    )
    assert seconds < QUICK


def test_stale_socket_file_exits_2_quickly(sock_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(sock_path)  # the file stays behind, nobody listens
    assert os.path.exists(sock_path)
    code, _, err, seconds = elasticctl("status", "j-1", env={"ELASTICD_SOCKET": sock_path})
    assert code == 2
    assert (
        err
        == f"elasticd is not running (no control socket at {sock_path}); {paths.REACH_ELSEWHERE}\n"
    )
    assert seconds < QUICK


def test_version_without_daemon_still_shows_the_client(sock_path):
    code, out, err, _ = elasticctl("--socket", sock_path, "version")
    assert (code, out) == (2, f"elasticctl {__version__}\n")
    assert "elasticd is not running" in err


def test_version_json_without_daemon_is_one_document(sock_path):
    code, out, _, _ = elasticctl("--socket", sock_path, "--json", "version")
    doc = json.loads(out)
    assert code == 2
    assert doc["elasticctl"] == __version__ and doc["elasticd"] is None
    assert doc["error"]["code"] == "not_running"


# -- streams --------------------------------------------------------------------------------


def log_stream(req):
    lines = [
        {"rank": 0, "stream": "out", "attempt": 0, "node": "n1", "text": "epoch 1"},
        {"rank": 1, "stream": "err", "attempt": 0, "node": "n1", "text": "warn"},
    ]
    return [
        protocol.ok(req.id, {"lines": lines[:1]}),
        protocol.ok(req.id, {"lines": lines[1:]}),
        protocol.end(req.id),
    ]


def test_logs_stream_until_end(daemon, sock_path, capsys):
    stand_in = daemon(log_stream)
    assert run(sock_path, "logs", "j-1", "--rank", "0") == 0
    assert capsys.readouterr().out == "[rank 0] epoch 1\n[rank 1 err] warn\n"
    assert stand_in.requests[0].args == {"job": "j-1", "follow": False, "rank": 0}


def test_logs_json_is_one_line_per_log_line(daemon, sock_path, capsys):
    daemon(log_stream)
    assert run(sock_path, "--json", "logs", "j-1", "-f", "--attempt", "0") == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["rank"], line["text"]) for line in lines] == [(0, "epoch 1"), (1, "warn")]


@pytest.mark.parametrize("final,status", [("SUCCEEDED", 0), ("FAILED", 1), ("CANCELLED", 130)])
def test_submit_wait_exits_with_the_jobs_outcome(daemon, sock_path, capsys, final, status):
    error = (
        {"message": "boom", "rank": 1, "node": "n1", "exit_code": 1} if final == "FAILED" else None
    )
    docs = [
        job_doc("PENDING"),
        job_doc("RUNNING"),
        job_doc("RUNNING"),
        job_doc(final, error=error, exit_code=1 if error else None),
    ]
    stand_in = daemon(lambda req: [protocol.ok(req.id, d) for d in docs] + [protocol.end(req.id)])
    assert run(sock_path, "submit", "--wait", "train.py") == status
    out = capsys.readouterr().out.splitlines()
    assert stand_in.requests[0].args["wait"] is True
    assert out[0] == "job j-7f3a21 submitted (waiting for 1 node)"
    assert [line.split()[1] for line in out[1:4]] == ["PENDING", "RUNNING", final]
    assert out[4:] == (["error: boom (rank 1 on node n1, exit code 1)"] if error else [])


def test_submit_wait_json_is_ndjson(daemon, sock_path, capsys):
    docs = [job_doc("PENDING"), job_doc("SUCCEEDED", exit_code=0)]
    daemon(lambda req: [protocol.ok(req.id, d) for d in docs] + [protocol.end(req.id)])
    assert run(sock_path, "--json", "submit", "--wait", "train.py") == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == docs


def test_stream_ending_before_the_job_does_is_an_error(daemon, sock_path, capsys):
    daemon(lambda req: [protocol.ok(req.id, job_doc("RUNNING")), protocol.end(req.id)])
    assert run(sock_path, "submit", "--wait", "train.py") == 1
    assert "ended the stream while the job was RUNNING" in capsys.readouterr().err


def test_ctrl_c_while_following_exits_130_cleanly(daemon, sock_path):
    line = {"rank": 0, "stream": "out", "attempt": 0, "node": "n1", "text": "first"}
    daemon(lambda req: [protocol.ok(req.id, {"lines": [line]})])  # then silence, forever
    # SIGINT as a terminal leaves it: a test runner started in the background (as CI may
    # be) would pass it on ignored, and Python then leaves it ignored, as it should for
    # a script's background job
    follower = subprocess.Popen(
        with_sigint(
            signal.SIG_DFL,
            [sys.executable, "-m", "elasticctl", "--socket", sock_path, "logs", "-f", "j-1"],
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = follower.stdout.readline()
        assert first == "[rank 0] first\n", (first, follower.poll(), follower.stderr.read())
        follower.send_signal(signal.SIGINT)
        assert follower.wait(timeout=EXIT_BOUND) == 130
        assert "Traceback" not in follower.stderr.read()
    finally:
        follower.kill()
        follower.wait()
