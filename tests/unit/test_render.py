"""Rendering of control documents: pure functions, table by table."""

from __future__ import annotations

import json
import re

import pytest

from elasticctl import cli, output, render
from elasticctl.client import Unavailable

NOW = 1_700_000_000.0


def job(**overrides):
    doc = {
        "id": "j-7f3a21",
        "name": "train.py",
        "state": "RUNNING",
        "user": "alice",
        "uid": 1000,
        "nnodes": "2:4",
        "nproc_per_node": 2,
        "restarts": 0,
        "max_restarts": 1,
        "created": NOW - 192,
        "started": NOW - 190,
        "ended": None,
        "exit_code": None,
        "round": 0,
        "world_size": 2,
        "argv": ["train.py", "--epochs", "10"],
        "workdir": "/w",
        "workers": [
            {
                "rank": 0,
                "local_rank": 0,
                "node": "n1",
                "pid": 4242,
                "state": "HEALTHY",
                "exit_code": None,
            },
            {
                "rank": 1,
                "local_rank": 1,
                "node": "n1",
                "pid": 4243,
                "state": "HEALTHY",
                "exit_code": None,
            },
        ],
        "nodes": [{"node": "n1", "group_rank": 0, "ranks": [0, 1], "state": "RUNNING"}],
        "error": None,
        "barrier": None,
    }
    doc.update(overrides)
    return doc


FAILURE = {
    "message": "ValueError: boom",
    "traceback": "Traceback (most recent call last):\n"
    '  File "train.py", line 3\nValueError: boom\n',
    "rank": 1,
    "node": "n1",
    "exit_code": 1,
}


def test_table_aligns_columns_without_trailing_blanks():
    assert render.table(("A", "LONG HEADER", "C"), [("xxxx", 1, None), ("y", "", "last")]) == (
        "A     LONG HEADER  C\nxxxx  1            -\ny     -            last"
    )


def test_table_of_nothing_is_its_header():
    assert render.table(("ID", "NAME"), []) == "ID  NAME"


@pytest.mark.parametrize(
    "seconds,expected",
    [
        (0, "0s"),
        (42.9, "42s"),
        (60, "1m"),
        (192, "3m12s"),
        (3600, "1h"),
        (7500, "2h5m"),
        (86400, "1d"),
        (3 * 86400 + 4 * 3600 + 59, "3d4h"),
        (-5, "0s"),
    ],
)
def test_duration(seconds, expected):
    assert render.duration(seconds) == expected


@pytest.mark.parametrize(
    "numbers,expected",
    [
        ([], "-"),
        ([3], "3"),
        ([0, 1, 2, 3], "0-3"),
        ([5, 0, 1, 2], "0-2,5"),
        ([0, 2, 4], "0,2,4"),
    ],
)
def test_ranks(numbers, expected):
    assert render.ranks(numbers) == expected


@pytest.mark.parametrize(
    "nnodes,expected",
    [
        ("2:4", "job j-7f3a21 submitted (waiting for 2..4 nodes)"),
        ("1:1", "job j-7f3a21 submitted (waiting for 1 node)"),
        ("1", "job j-7f3a21 submitted (waiting for 1 node)"),
        ("3:3", "job j-7f3a21 submitted (waiting for 3 nodes)"),
        (None, "job j-7f3a21 submitted"),
    ],
)
def test_submitted_line(nnodes, expected):
    assert render.submitted_line({"id": "j-7f3a21", "nnodes": nnodes}) == expected


@pytest.mark.parametrize(
    "doc,expected",
    [
        (job(), "j-7f3a21  RUNNING  workers 2/2  restarts 0/1  round 0"),
        (
            job(state="PENDING", workers=[], world_size=None, round=None, nodes=[]),
            "j-7f3a21  PENDING  workers -  restarts 0/1  round -",
        ),
        (
            job(
                state="RESTARTING",
                restarts=1,
                workers=[dict(job()["workers"][0], state="STOPPED"), job()["workers"][1]],
            ),
            "j-7f3a21  RESTARTING  workers 1/2  restarts 1/1  round 0",
        ),
        (
            job(barrier={"done": 3, "total": 4, "deadline": NOW + 212.4}),
            "j-7f3a21  RUNNING  workers 2/2  restarts 0/1  round 0  exit barrier 3/4 nodes done, 212 s left",
        ),
        (
            job(state="SUCCEEDED", exit_code=0, ended=NOW),
            "j-7f3a21  SUCCEEDED  restarts 0/1  round 0  exit 0",
        ),
        (
            job(state="FAILED", exit_code=1, restarts=1, round=1, error=FAILURE),
            "j-7f3a21  FAILED  restarts 1/1  round 1  exit 1",
        ),
        (
            {"id": "j-1", "state": "PENDING", "surprise": {"new": "key"}},
            "j-1  PENDING  workers -  restarts -/-  round -",
        ),
    ],
)
def test_progress_line(doc, expected):
    assert render.progress_line(doc, NOW) == expected


@pytest.mark.parametrize(
    "barrier,expected",
    [
        (None, None),
        ({"done": 3, "total": 4, "deadline": NOW + 212}, "3/4 nodes done, 212 s left"),
        ({"done": 1, "total": 2, "deadline": NOW - 5}, "1/2 nodes done, 0 s left"),
        ({"done": 1, "total": 2}, "1/2 nodes done"),
    ],
)
def test_barrier_progress(barrier, expected):
    assert render.barrier_progress(barrier, NOW) == expected


@pytest.mark.parametrize(
    "error,expected",
    [
        (None, None),
        (FAILURE, "error: ValueError: boom (rank 1 on node n1, exit code 1)"),
        (
            {"message": "daemon died", "rank": None, "node": "n2", "exit_code": None},
            "error: daemon died (on node n2)",
        ),
        (
            {"message": "worker exited", "rank": 0, "exit_code": -9},
            "error: worker exited (rank 0, exit code -9)",
        ),
        (
            {"message": "not enough nodes joined within 600 s"},
            "error: not enough nodes joined within 600 s",
        ),
    ],
)
def test_error_summary(error, expected):
    assert render.error_summary(error) == expected


def test_jobs_table():
    jobs = [
        job(allocated=2),
        job(
            id="j-000001",
            name="other",
            user="bob",
            state="SUCCEEDED",
            ended=NOW - 7200,
            exit_code=0,
            nnodes="1:1",
            world_size=1,
            workers=[],
            nodes=[{"node": "n2"}],
        ),
        job(
            id="j-000002",
            name=None,
            state="PENDING",
            nodes=[],
            workers=[],
            world_size=None,
            created=NOW - 5,
            allocated=0,
            reason="Priority",
        ),
    ]
    assert render.jobs_table(jobs, NOW).splitlines() == [
        "ID        NAME      USER   STATE      NODES    ALLOC       WORKERS  RESTARTS  AGE/ENDED",
        "j-7f3a21  train.py  alice  RUNNING    1 (2:4)  2           2/2      0/1       3m12s",
        "j-000001  other     bob    SUCCEEDED  1 (1:1)  -           0/1      0/1       2h ago",
        "j-000002  -         alice  PENDING    0 (2:4)  (Priority)  -        0/1       5s",
    ]


def test_status_block_of_a_running_job():
    text = render.status_block(
        job(
            barrier={"done": 1, "total": 2, "deadline": NOW + 30},
            python="/home/alice/venv/bin/python3",
        ),
        NOW,
    )
    lines = text.splitlines()
    assert lines[:7] == [
        "id:           j-7f3a21",
        "name:         train.py",
        "user:         alice (uid 1000)",
        "state:        RUNNING",
        "command:      train.py --epochs 10",
        "python:       /home/alice/venv/bin/python3",
        "workdir:      /w",
    ]
    assert "restarts:     0/1" in lines
    assert "round:        0" in lines
    assert f"created:      {render.local_time(NOW - 192)}" in lines
    assert "ended:        -" in lines
    assert "exit barrier: 1/2 nodes done, 30 s left" in lines
    assert "NODE  GROUP RANK  RANKS  STATE    CPU  MEM PEAK" in lines
    assert "n1    0           0-1    RUNNING  -    -" in lines
    assert "RANK  LOCAL  NODE  PID   STATE    EXIT" in lines
    assert "1     1      n1    4243  HEALTHY  -" in lines


def test_status_block_of_a_failed_job_shows_the_root_cause_indented():
    doc = job(state="FAILED", exit_code=1, ended=NOW, error=FAILURE, workers=[], nodes=[])
    lines = render.status_block(doc, NOW).splitlines()
    assert "exit code:    1" in lines
    cause = lines.index("error: ValueError: boom (rank 1 on node n1, exit code 1)")
    assert lines[cause + 1 :] == [
        "traceback:",
        "    Traceback (most recent call last):",
        '      File "train.py", line 3',
        "    ValueError: boom",
    ]


def test_jobs_table_of_list_rows_uses_their_counts():
    row = {
        "id": "j-7f3a21",
        "name": "train.py",
        "user": "alice",
        "state": "RUNNING",
        "nnodes": "2:4",
        "node_count": 2,
        "workers_up": 3,
        "workers_total": 4,
        "world_size": 4,
        "restarts": 0,
        "max_restarts": 1,
        "created": NOW - 5,
        "ended": None,
    }
    assert (
        render.jobs_table([row], NOW).splitlines()[1]
        == "j-7f3a21  train.py  alice  RUNNING  2 (2:4)  -      3/4      0/1       5s"
    )


def test_another_users_job_says_what_is_hidden():
    doc = job(
        state="FAILED",
        exit_code=1,
        ended=NOW,
        argv=["train.py"],
        redacted=True,
        error={**FAILURE, "message": "", "traceback": ""},
        workers=[],
        nodes=[],
    )
    lines = render.status_block(doc, NOW).splitlines()
    assert "command:      train.py ... (shown to the job's owner and admins only)" in lines
    assert lines[-1] == (
        "error: (shown to the job's owner and admins only) (rank 1 on node n1, exit code 1)"
    )
    assert "traceback:" not in lines


def test_status_block_shows_the_schedulers_fields_where_not_default():
    plain = render.status_block(
        job(account="alice", priority=0, nnodes_step=1, preemptible=False), NOW
    )
    assert "account:      alice" in plain.splitlines()
    assert not any(word in plain for word in ("priority", "nnodes step", "preemptible"))
    lines = render.status_block(
        job(account="ml", priority=-5, nnodes_step=2, preemptible=True), NOW
    ).splitlines()
    at = lines.index("account:      ml")
    assert lines[at : at + 4] == [
        "account:      ml",
        "priority:     -5",
        "nnodes step:  2",
        "preemptible:  yes",
    ]
    assert "account" not in render.status_block(job(), NOW)  # a daemon that does not send it


def test_status_block_of_a_sparse_document():
    lines = render.status_block({"id": "j-1"}, NOW).splitlines()
    assert lines[0] == "id:           j-1"
    assert "state:        -" in lines and "restarts:     -/-" in lines


def test_nodes_table():
    full = {
        "cgroup": True,
        "pids_per_worker": 1024,
        "pids_by": "cgroup v2",
        "memory": 8 << 30,
        "memory_by": "cgroup v2",
        "missing": [],
    }
    nodes = [
        {
            "name": "n1",
            "address": "127.0.0.1",
            "state": "up",
            "slots_total": 8,
            "slots_free": 6,
            "gpus_total": 4,
            "gpus_free": 0,
            "jobs": ["j-7f3a21", "j-000002"],
            "last_seen": NOW - 2,
            "version": "0.1.0",
            "labels": {},
            "containment": full,
        },
        {
            "name": "node-two",
            "address": "127.0.0.2",
            "state": "draining",
            "slots_total": 8,
            "slots_free": 8,
            "gpus_total": 0,
            "gpus_free": 0,
            "jobs": [],
            "last_seen": None,
        },
    ]
    assert render.nodes_table(nodes, NOW).splitlines() == [
        "NAME      ADDRESS    STATE     SLOTS  GPUS  JOBS               LAST SEEN  CGROUP  PIDS         MEMORY",
        "n1        127.0.0.1  up        6/8    0/4   j-7f3a21,j-000002  2s ago     yes     1024/worker  8.0 GiB",
        "node-two  127.0.0.2  draining  8/8    0/0   -                  -          -       -            -",
    ]


def test_nodes_table_says_which_gpus_are_out_and_why():
    base = {
        "address": "127.0.0.1",
        "state": "up",
        "slots_total": 8,
        "slots_free": 8,
        "gpus_free": 7,
        "jobs": [],
        "last_seen": NOW,
    }
    nodes = [
        base | {"name": "gpu-07", "gpus_total": 7, "gpus_out": {"3": "xid 79"}},
        base
        | {
            "name": "gpu-08",
            "gpus_total": 6,
            "gpus_out": {"0": "lost", "5": "ecc: 2 new \x1b[31m"},
        },
        base | {"name": "gpu-09", "gpus_total": 8, "gpus_out": "junk"},
    ]
    assert render.nodes_table(nodes, NOW).splitlines()[-2:] == [
        "gpu-07: gpus 7/8, gpu 3: xid 79",
        "gpu-08: gpus 6/8, gpu 0: lost, gpu 5: ecc: 2 new \\x1b[31m",
    ]


def test_nodes_table_says_what_a_node_cannot_bound():
    """CGROUP, PIDS and MEMORY say what bounds a job there; each thing missing gets a line."""
    base = {
        "address": "127.0.0.1",
        "state": "up",
        "slots_total": 2,
        "slots_free": 2,
        "gpus_total": 0,
        "gpus_free": 0,
        "jobs": [],
        "last_seen": NOW,
    }
    nodes = [
        base
        | {
            "name": "a",
            "containment": {
                "cgroup": False,
                "pids_per_worker": 64,
                "pids_by": "RLIMIT_NPROC",
                "memory": 1 << 30,
                "memory_by": "",
                "missing": ["no cgroups for jobs (off)", "no pids \x1b[31mcontroller"],
            },
        },
        base
        | {
            "name": "b",
            "containment": {
                "cgroup": True,
                "pids_per_worker": 0,
                "pids_by": "",
                "memory": 0,
                "memory_by": "cgroup v1",
                "missing": "not a list",
            },
        },
        base | {"name": "c", "containment": {"pids_per_worker": 8, "pids_by": ""}},
    ]
    lines = render.nodes_table(nodes, NOW).splitlines()
    assert [re.split(r"\s{2,}", line)[-3:] for line in lines[1:4]] == [
        ["no", "64/worker (RLIMIT_NPROC)", "1.0 GiB (not enforced)"],
        ["yes", "no limit", "no limit"],
        ["no", "8/worker (not enforced)", "no limit"],
    ]
    assert lines[4:] == ["", "a: no cgroups for jobs (off)", "a: no pids \\x1b[31mcontroller"]


def test_nodes_table_shows_the_blacklist_and_discovery():
    base = {
        "address": "127.0.0.1",
        "slots_total": 2,
        "slots_free": 2,
        "gpus_total": 0,
        "gpus_free": 0,
        "jobs": [],
        "last_seen": NOW,
    }
    nodes = [
        base | {"name": "a", "state": "blacklisted", "blacklisted_until": NOW + 75.4},
        base | {"name": "b", "state": "drained", "listed": False},
        base | {"name": "c", "state": "draining", "listed": True},
        base | {"name": "d", "state": "blacklisted", "blacklisted_until": NOW - 3},
        base | {"name": "e", "state": "blacklisted", "blacklisted_until": float("inf")},
    ]
    states = [
        "blacklisted (1m15s left)",
        "drained (not listed)",
        "draining",
        "blacklisted (0s left)",
        "blacklisted",
    ]
    assert [render.node_state(n, NOW) for n in nodes] == states
    lines = render.nodes_table(nodes, NOW).splitlines()[1:]
    assert all(f"  {state}  " in line for line, state in zip(lines, states))


@pytest.mark.parametrize(
    "line,expected",
    [
        (
            {"rank": 0, "stream": "out", "attempt": 0, "node": "n1", "text": "epoch 1 loss 0.5"},
            "[rank 0] epoch 1 loss 0.5",
        ),
        ({"rank": 12, "stream": "err", "attempt": 0, "text": "warning\n"}, "[rank 12 err] warning"),
        (
            {"rank": 1, "stream": "out", "attempt": 2, "text": "resumed"},
            "[rank 1 attempt 2] resumed",
        ),
        ({"rank": 1, "stream": "err", "attempt": 1, "text": ""}, "[rank 1 attempt 1 err] "),
    ],
)
def test_log_line(line, expected):
    assert render.log_line(line) == expected


@pytest.mark.parametrize(
    "doc,expected",
    [
        ({"id": "j-1", "state": "CANCELLED"}, "job j-1 cancelled"),
        ({"id": "j-1", "state": "RUNNING"}, "job j-1 cancelled"),
        ({"id": "j-1", "state": "SUCCEEDED"}, "job j-1 had already ended (SUCCEEDED)"),
        (None, "job j-asked cancelled"),
    ],
)
def test_cancelled_line(doc, expected):
    assert render.cancelled_line(doc, "j-asked") == expected


@pytest.mark.parametrize(
    "doc,op,expected",
    [
        ({"name": "n1", "state": "draining"}, "drain", "node n1 draining"),
        ({"name": "n1", "state": "up"}, "undrain", "node n1 up"),
        (None, "drain", "node n1: drain requested"),
    ],
)
def test_node_changed_line(doc, op, expected):
    assert render.node_changed_line(doc, "n1", op) == expected


def test_daemon_version_line():
    assert (
        render.daemon_version_line({"version": "0.1.0", "node": "n1"})
        == "elasticd 0.1.0 on node n1"
    )


# -- terminal safety: every value is data that other users or their jobs control ------------

HOSTILE = "evil\x1b]0;pwned\x07\r\nj-000000  fake  row\x9b31m\u202eabc\ud800"
ESCAPED = r"evil\x1b]0;pwned\x07\r\nj-000000  fake  row\x9b31m\u202eabc\ud800"
UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def assert_safe(out, lines):
    """``out`` has ``lines`` lines, none with a character that a terminal would act on."""
    assert len(out.split("\n")) == lines
    for line in out.split("\n"):
        assert not UNSAFE.search(line), line


@pytest.mark.parametrize(
    "char,expected",
    [
        ("\x00", r"\x00"),
        ("\x07", r"\x07"),
        ("\t", r"\t"),
        ("\n", r"\n"),
        ("\r", r"\r"),
        ("\x1b", r"\x1b"),
        ("\x1f", r"\x1f"),
        ("\x7f", r"\x7f"),
        ("\x80", r"\x80"),
        ("\x9b", r"\x9b"),
        ("\x9f", r"\x9f"),
        ("\u061c", r"\u061c"),
        ("\u200e", r"\u200e"),
        ("\u200f", r"\u200f"),
        ("\u202a", r"\u202a"),
        ("\u202e", r"\u202e"),
        ("\u2066", r"\u2066"),
        ("\u2069", r"\u2069"),
        ("\ud800", r"\ud800"),
        ("\udfff", r"\udfff"),
        # kept: printable text, a backslash (display, not a codec), other non-printables
        (" ", " "),
        ("\\", "\\"),
        ("\xa0", "\xa0"),
        ("é", "é"),
        ("\u4e2d", "\u4e2d"),
        ("\u2028", "\u2028"),
    ],
)
def test_clean_escapes_each_control_character(char, expected):
    assert render.clean(f"a{char}b") == f"a{expected}b"


def test_clean_leaves_safe_text_alone():
    value = "train.py --lr=1e-3 C:\\x1b ünïcødé"
    assert render.clean(value) is value
    assert render.clean("a\tb", keep_tabs=True) == "a\tb"
    assert render.clean("a\tb\x1b", keep_tabs=True) == "a\tb" r"\x1b"
    assert render.clean(HOSTILE) == ESCAPED
    assert render.clean(ESCAPED) == ESCAPED


def hostile_job(v):
    return job(
        id=v,
        name=v,
        user=v,
        uid=v,
        state=v,
        argv=[v, v],
        workdir=v,
        nnodes=v,
        account=v,
        priority=v,
        nnodes_step=v,
        preemptible=v,
        nproc_per_node=v,
        world_size=v,
        restarts=v,
        max_restarts=v,
        round=v,
        exit_code=v,
        barrier={"done": v, "total": v, "deadline": NOW + 5},
        error={"message": v, "rank": v, "node": v, "exit_code": v},
        nodes=[{"node": v, "group_rank": v, "ranks": [v], "state": v}],
        workers=[{"rank": v, "local_rank": v, "node": v, "pid": v, "state": v, "exit_code": v}],
    )


NODE_FIELDS = ("name", "address", "state", "slots_total", "slots_free", "gpus_total", "gpus_free")

RENDERERS = {
    "table": lambda v: render.table(("A", "B"), [(v, v)]),
    "text": render.text,
    "jobs_table": lambda v: render.jobs_table([hostile_job(v), job()], NOW),
    "status_block": lambda v: render.status_block(hostile_job(v), NOW),
    "nodes_table": lambda v: render.nodes_table(
        [dict.fromkeys(NODE_FIELDS, v) | {"jobs": [v, v], "last_seen": NOW - 2}], NOW
    ),
    "nodes_table containment": lambda v: render.nodes_table(
        [
            dict.fromkeys(NODE_FIELDS, v)
            | {
                "jobs": [],
                "last_seen": NOW,
                "containment": dict.fromkeys(
                    ("cgroup", "pids_per_worker", "pids_by", "memory", "memory_by"), v
                )
                | {"missing": [v, v]},
            }
        ],
        NOW,
    ),
    "nodes_of_job_table": lambda v: render.nodes_of_job_table(hostile_job(v)["nodes"]),
    "workers_table": lambda v: render.workers_table(hostile_job(v)["workers"]),
    "error_summary": lambda v: render.error_summary(
        {"message": v, "rank": v, "node": v, "exit_code": v}
    ),
    "log_line": lambda v: render.log_line({"rank": v, "attempt": v, "stream": "err", "text": v}),
    "progress_line": lambda v: render.progress_line(hostile_job(v), NOW),
    "progress_line ended": lambda v: render.progress_line(
        hostile_job(v) | {"state": "FAILED"}, NOW
    ),
    "submitted_line": lambda v: render.submitted_line({"id": v, "nnodes": v}),
    "cancelled_line": lambda v: render.cancelled_line({"id": v, "state": v}, v),
    "cancelled_line without a job": lambda v: render.cancelled_line(None, v),
    "node_changed_line": lambda v: render.node_changed_line({"state": v}, v, v),
    "node_changed_line requested": lambda v: render.node_changed_line(None, v, v),
    "daemon_version_line": lambda v: render.daemon_version_line(
        {"version": v, "node": v, "store": v, "cluster": v}
    ),
    "barrier_progress": lambda v: render.barrier_progress(
        {"done": v, "total": v, "deadline": NOW}, NOW
    ),
}


@pytest.mark.parametrize("name", RENDERERS)
def test_hostile_values_show_escaped_and_forge_no_line(name):
    rendered = RENDERERS[name]
    out = rendered(HOSTILE)
    assert_safe(out, lines=len(rendered("x").split("\n")))
    assert ESCAPED in out
    assert r"\x1b]0;pwned\x07" in out


def test_log_line_keeps_tabs_and_escapes_the_rest():
    line = {"rank": 0, "stream": "out", "text": "step\t1\tloss\r\x1b[2Kfake\n"}
    assert render.log_line(line) == "[rank 0] step\t1\tloss" r"\r\x1b[2Kfake"
    assert render.log_line({"rank": "0\t1", "text": ""}) == r"[rank 0\t1] "


def test_traceback_lines_stay_lines_each_escaped():
    error = {
        "message": "ValueError: \x1b[2Jboom",
        "traceback": "Traceback (most recent call last):\r\n"
        '  File "x\x1b]0;t\x07.py", line 3\n\x1b[1A\x1b[2K\rforged\nValueError: \u202eboom\n',
    }
    lines = render.status_block({"id": "j-1", "error": error}, NOW).split("\n")
    cause = lines.index(r"error: ValueError: \x1b[2Jboom")
    assert lines[cause + 1 :] == [
        "traceback:",
        "    Traceback (most recent call last):",
        r'      File "x\x1b]0;t\x07.py", line 3',
        r"    \x1b[1A\x1b[2K\rforged",
        r"    ValueError: \u202eboom",
    ]


def test_table_aligns_on_the_escaped_width():
    assert render.table(("A", "B"), [("\x1b", 1), ("ab", "\u202e")]) == (
        "A     B\n"
        r"\x1b  1"
        "\n"
        r"ab    \u202e"
    )


def test_json_output_is_the_exact_document(capsys):
    doc = {"jobs": [{"id": "j-1", "name": HOSTILE, "argv": ["\t", "\\x1b", "\u202e"]}]}
    output.emit(
        cli.parse_args(["--json", "list"]), doc, lambda: pytest.fail("rendered with --json")
    )
    out = capsys.readouterr().out
    assert out.isascii() and out.count("\n") == 1
    assert json.loads(out) == doc


def test_human_messages_of_the_cli_are_escaped(monkeypatch, capsys):
    def docs():
        yield {"id": HOSTILE, "state": "RUNNING"}
        raise KeyboardInterrupt

    def unreachable(args):
        raise Unavailable(HOSTILE)

    assert cli.follow_job(cli.parse_args(["submit", "x.py"]), docs()) == 130
    assert cli.fail(cli.parse_args(["list"]), "not_found", HOSTILE, 1) == 1
    monkeypatch.setattr(cli, "connect", unreachable)
    assert cli.cmd_version(cli.parse_args(["version"])) == 2
    out, err = capsys.readouterr()
    assert_safe(out.rstrip("\n"), lines=3)
    assert_safe(err.rstrip("\n"), lines=3)
    assert err.count(ESCAPED) == 4


def test_cli_errors_with_json_keep_the_message_exact(capsys):
    assert cli.fail(cli.parse_args(["--json", "list"]), "not_found", HOSTILE, 1) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == {"error": {"code": "not_found", "message": HOSTILE}}
    assert err == f"elasticctl: {ESCAPED}\n"


@pytest.mark.parametrize(
    "usage, expected",
    [
        (
            {"cpu_seconds": 0.4231, "memory_peak": 1288490189, "oom_kills": 0},
            "cpu 0.42s, memory peak 1.2 GiB (largest node)",
        ),
        ({"cpu_seconds": 90.5, "oom_kills": 2}, "cpu 1m30s, 2 OOM kills"),
        ({"memory_peak": 512, "oom_kills": 1}, "memory peak 512 B (largest node), 1 OOM kill"),
        ({}, "-"),
    ],
)
def test_usage_line(usage, expected):
    assert render.usage_line(usage) == expected


def test_status_shows_usage_per_node_and_in_all():
    usage = {"cpu_seconds": 3.0, "memory_peak": 2 << 20}
    block = render.status_block(
        job(
            usage=usage,
            nodes=[
                {
                    "node": "n1",
                    "group_rank": 0,
                    "ranks": [0, 1],
                    "state": "RUNNING",
                    "usage": usage,
                },
                {"node": "n2", "group_rank": 1, "ranks": [2, 3], "state": "RUNNING", "usage": None},
            ],
        ),
        NOW,
    )
    assert "usage:        cpu 3.00s, memory peak 2.0 MiB (largest node)" in block
    rows = [line.split() for line in block.splitlines() if line.startswith(("NODE", "n1", "n2"))]
    assert rows == [
        ["NODE", "GROUP", "RANK", "RANKS", "STATE", "CPU", "MEM", "PEAK"],
        ["n1", "0", "0-1", "RUNNING", "3.00s", "2.0", "MiB"],
        ["n2", "1", "2-3", "RUNNING", "-", "-"],
    ]


def test_status_shows_a_warm_restart_job_s_standbys_as_its_nodes_said():
    def node(name: str, usage: dict | None) -> dict:
        return {"node": name, "group_rank": 0, "ranks": [0], "state": "RUNNING", "usage": usage}

    def line(*nodes: dict) -> str:
        block = render.status_block(job(warm_restart=True, nodes=list(nodes)), NOW)
        return next(x for x in block.splitlines() if x.startswith("warm restart:"))

    def shown(**fields) -> bool:
        block = render.status_block(job(warm_restart=True, nodes=[waiting], **fields), NOW)
        return "warm restart" in block

    waiting = node("n1", {"cpu_seconds": 1.0, "standbys": 3})
    assert line(waiting, node("n2", {"standbys": 0})) == (
        "warm restart: 3 standbys waiting (on 1 of 2 nodes)"
    )
    assert line(node("n1", {"standbys": 1})) == "warm restart: 1 standby waiting (on 1 of 1 nodes)"
    # an older daemon's part reports none
    assert line(node("n1", None)) == "warm restart: no standby reported yet"
    assert "warm restart" not in render.status_block(job(nodes=[waiting]), NOW)
    # a lost node's standbys are gone; an ended job's last parts still count theirs
    lost = {**node("n2", {"standbys": 2}), "state": "LOST"}
    assert line(waiting, lost) == "warm restart: 3 standbys waiting (on 1 of 2 nodes)"
    assert shown(state="RUNNING") and shown(state="RESTARTING")
    assert not any(shown(state=s) for s in ("SUCCEEDED", "FAILED", "CANCELLED"))


def test_queue_shows_how_long_each_job_has_waited_since_it_last_stopped():
    """WAITED counts from the submit, or, for a job that ran and was stopped (preempted,
    requeued), from when it stopped; a daemon that does not say when counts from the submit."""
    row = {
        "position": 1,
        "id": "j-0c3a77",
        "name": "big.py",
        "user": "carol",
        "account": "ml",
        "priority": 0,
        "nnodes": "4:4",
        "reason": "Resources",
        "preempted": True,
        "submitted": NOW - 3600,
    }
    requeued = render.queue_table(
        {"scheduler": True, "jobs": [{**row, "waiting_since": NOW - 42}]}, NOW
    )
    assert requeued.splitlines()[1].split()[-3:] == ["Resources", "(preempted)", "42s"]
    older = render.queue_table({"scheduler": True, "jobs": [row]}, NOW)
    assert older.splitlines()[1].split()[-1] == "1h"
