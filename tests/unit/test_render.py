"""Rendering of control documents: pure functions, table by table."""

from __future__ import annotations

import pytest

from elasticctl import render

NOW = 1_700_000_000.0


def job(**overrides):
    doc = {
        "id": "j-7f3a21", "name": "train.py", "state": "RUNNING", "user": "alice", "uid": 1000,
        "nnodes": "2:4", "nproc_per_node": 2, "restarts": 0, "max_restarts": 1,
        "created": NOW - 192, "started": NOW - 190, "ended": None, "exit_code": None,
        "round": 0, "world_size": 2, "argv": ["train.py", "--epochs", "10"], "workdir": "/w",
        "workers": [
            {"rank": 0, "local_rank": 0, "node": "n1", "pid": 4242, "state": "HEALTHY", "exit_code": None},
            {"rank": 1, "local_rank": 1, "node": "n1", "pid": 4243, "state": "HEALTHY", "exit_code": None},
        ],
        "nodes": [{"node": "n1", "group_rank": 0, "ranks": [0, 1], "state": "RUNNING"}],
        "error": None, "barrier": None,
    }
    doc.update(overrides)
    return doc


FAILURE = {"message": "ValueError: boom", "traceback": "Traceback (most recent call last):\n"
           "  File \"train.py\", line 3\nValueError: boom\n", "rank": 1, "node": "n1", "exit_code": 1}


def test_table_aligns_columns_without_trailing_blanks():
    assert render.table(("A", "LONG HEADER", "C"), [("xxxx", 1, None), ("y", "", "last")]) == (
        "A     LONG HEADER  C\n"
        "xxxx  1            -\n"
        "y     -            last")


def test_table_of_nothing_is_its_header():
    assert render.table(("ID", "NAME"), []) == "ID  NAME"


@pytest.mark.parametrize("seconds,expected", [
    (0, "0s"), (42.9, "42s"), (60, "1m"), (192, "3m12s"), (3600, "1h"), (7500, "2h5m"),
    (86400, "1d"), (3 * 86400 + 4 * 3600 + 59, "3d4h"), (-5, "0s"),
])
def test_duration(seconds, expected):
    assert render.duration(seconds) == expected


@pytest.mark.parametrize("numbers,expected", [
    ([], "-"), ([3], "3"), ([0, 1, 2, 3], "0-3"), ([5, 0, 1, 2], "0-2,5"), ([0, 2, 4], "0,2,4"),
])
def test_ranks(numbers, expected):
    assert render.ranks(numbers) == expected


@pytest.mark.parametrize("nnodes,expected", [
    ("2:4", "job j-7f3a21 submitted (waiting for 2..4 nodes)"),
    ("1:1", "job j-7f3a21 submitted (waiting for 1 node)"),
    ("1", "job j-7f3a21 submitted (waiting for 1 node)"),
    ("3:3", "job j-7f3a21 submitted (waiting for 3 nodes)"),
    (None, "job j-7f3a21 submitted"),
])
def test_submitted_line(nnodes, expected):
    assert render.submitted_line({"id": "j-7f3a21", "nnodes": nnodes}) == expected


@pytest.mark.parametrize("doc,expected", [
    (job(), "j-7f3a21  RUNNING  workers 2/2  restarts 0/1  round 0"),
    (job(state="PENDING", workers=[], world_size=None, round=None, nodes=[]),
     "j-7f3a21  PENDING  workers -  restarts 0/1  round -"),
    (job(state="RESTARTING", restarts=1,
         workers=[dict(job()["workers"][0], state="STOPPED"), job()["workers"][1]]),
     "j-7f3a21  RESTARTING  workers 1/2  restarts 1/1  round 0"),
    (job(barrier={"done": 3, "total": 4, "deadline": NOW + 212.4}),
     "j-7f3a21  RUNNING  workers 2/2  restarts 0/1  round 0  exit barrier 3/4 nodes done, 212 s left"),
    (job(state="SUCCEEDED", exit_code=0, ended=NOW),
     "j-7f3a21  SUCCEEDED  restarts 0/1  round 0  exit 0"),
    (job(state="FAILED", exit_code=1, restarts=1, round=1, error=FAILURE),
     "j-7f3a21  FAILED  restarts 1/1  round 1  exit 1"),
    ({"id": "j-1", "state": "PENDING", "surprise": {"new": "key"}},
     "j-1  PENDING  workers -  restarts -/-  round -"),
])
def test_progress_line(doc, expected):
    assert render.progress_line(doc, NOW) == expected


@pytest.mark.parametrize("barrier,expected", [
    (None, None),
    ({"done": 3, "total": 4, "deadline": NOW + 212}, "3/4 nodes done, 212 s left"),
    ({"done": 1, "total": 2, "deadline": NOW - 5}, "1/2 nodes done, 0 s left"),
    ({"done": 1, "total": 2}, "1/2 nodes done"),
])
def test_barrier_progress(barrier, expected):
    assert render.barrier_progress(barrier, NOW) == expected


@pytest.mark.parametrize("error,expected", [
    (None, None),
    (FAILURE, "error: ValueError: boom (rank 1 on node n1, exit code 1)"),
    ({"message": "daemon died", "rank": None, "node": "n2", "exit_code": None},
     "error: daemon died (on node n2)"),
    ({"message": "worker exited", "rank": 0, "exit_code": -9}, "error: worker exited (rank 0, exit code -9)"),
    ({"message": "not enough nodes joined within 600 s"}, "error: not enough nodes joined within 600 s"),
])
def test_error_summary(error, expected):
    assert render.error_summary(error) == expected


def test_jobs_table():
    jobs = [job(),
            job(id="j-000001", name="other", user="bob", state="SUCCEEDED", ended=NOW - 7200,
                exit_code=0, nnodes="1:1", world_size=1, workers=[], nodes=[{"node": "n2"}]),
            job(id="j-000002", name=None, state="PENDING", nodes=[], workers=[], world_size=None,
                created=NOW - 5)]
    assert render.jobs_table(jobs, NOW).splitlines() == [
        "ID        NAME      USER   STATE      NODES    WORKERS  RESTARTS  AGE/ENDED",
        "j-7f3a21  train.py  alice  RUNNING    1 (2:4)  2/2      0/1       3m12s",
        "j-000001  other     bob    SUCCEEDED  1 (1:1)  0/1      0/1       2h ago",
        "j-000002  -         alice  PENDING    0 (2:4)  -        0/1       5s",
    ]


def test_status_block_of_a_running_job():
    text = render.status_block(job(barrier={"done": 1, "total": 2, "deadline": NOW + 30}), NOW)
    lines = text.splitlines()
    assert lines[:6] == [
        "id:           j-7f3a21",
        "name:         train.py",
        "user:         alice (uid 1000)",
        "state:        RUNNING",
        "command:      train.py --epochs 10",
        "workdir:      /w",
    ]
    assert "restarts:     0/1" in lines
    assert "round:        0" in lines
    assert f"created:      {render.local_time(NOW - 192)}" in lines
    assert "ended:        -" in lines
    assert "exit barrier: 1/2 nodes done, 30 s left" in lines
    assert "NODE  GROUP RANK  RANKS  STATE" in lines
    assert "n1    0           0-1    RUNNING" in lines
    assert "RANK  LOCAL  NODE  PID   STATE    EXIT" in lines
    assert "1     1      n1    4243  HEALTHY  -" in lines


def test_status_block_of_a_failed_job_shows_the_root_cause_indented():
    doc = job(state="FAILED", exit_code=1, ended=NOW, error=FAILURE, workers=[], nodes=[])
    lines = render.status_block(doc, NOW).splitlines()
    assert "exit code:    1" in lines
    cause = lines.index("error: ValueError: boom (rank 1 on node n1, exit code 1)")
    assert lines[cause + 1:] == [
        "traceback:",
        "    Traceback (most recent call last):",
        "      File \"train.py\", line 3",
        "    ValueError: boom",
    ]


def test_status_block_of_a_sparse_document():
    lines = render.status_block({"id": "j-1"}, NOW).splitlines()
    assert lines[0] == "id:           j-1"
    assert "state:        -" in lines and "restarts:     -/-" in lines


def test_nodes_table():
    nodes = [
        {"name": "n1", "address": "127.0.0.1", "state": "up", "slots_total": 8, "slots_free": 6,
         "gpus_total": 4, "gpus_free": 0, "jobs": ["j-7f3a21", "j-000002"], "last_seen": NOW - 2,
         "version": "0.1.0", "labels": {}},
        {"name": "node-two", "address": "127.0.0.2", "state": "draining", "slots_total": 8,
         "slots_free": 8, "gpus_total": 0, "gpus_free": 0, "jobs": [], "last_seen": None},
    ]
    assert render.nodes_table(nodes, NOW).splitlines() == [
        "NAME      ADDRESS    STATE     SLOTS  GPUS  JOBS               LAST SEEN",
        "n1        127.0.0.1  up        6/8    0/4   j-7f3a21,j-000002  2s ago",
        "node-two  127.0.0.2  draining  8/8    0/0   -                  -",
    ]


@pytest.mark.parametrize("line,expected", [
    ({"rank": 0, "stream": "out", "attempt": 0, "node": "n1", "text": "epoch 1 loss 0.5"},
     "[rank 0] epoch 1 loss 0.5"),
    ({"rank": 12, "stream": "err", "attempt": 0, "text": "warning\n"}, "[rank 12 err] warning"),
    ({"rank": 1, "stream": "out", "attempt": 2, "text": "resumed"}, "[rank 1 attempt 2] resumed"),
    ({"rank": 1, "stream": "err", "attempt": 1, "text": ""}, "[rank 1 attempt 1 err] "),
])
def test_log_line(line, expected):
    assert render.log_line(line) == expected


@pytest.mark.parametrize("doc,expected", [
    ({"id": "j-1", "state": "CANCELLED"}, "job j-1 cancelled"),
    ({"id": "j-1", "state": "RUNNING"}, "job j-1 cancelled"),
    ({"id": "j-1", "state": "SUCCEEDED"}, "job j-1 had already ended (SUCCEEDED)"),
    (None, "job j-asked cancelled"),
])
def test_cancelled_line(doc, expected):
    assert render.cancelled_line(doc, "j-asked") == expected


@pytest.mark.parametrize("doc,op,expected", [
    ({"name": "n1", "state": "draining"}, "drain", "node n1 draining"),
    ({"name": "n1", "state": "up"}, "undrain", "node n1 up"),
    (None, "drain", "node n1: drain requested"),
])
def test_node_changed_line(doc, op, expected):
    assert render.node_changed_line(doc, "n1", op) == expected


def test_daemon_version_line():
    assert render.daemon_version_line({"version": "0.1.0", "node": "n1"}) == "elasticd 0.1.0 on node n1"
