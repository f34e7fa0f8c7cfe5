"""Pure job model: state transitions, nnodes/nproc parsing, spec validation, ranks, worker env."""

import pytest

from elasticd.core.model import (
    JOB_STATES,
    NODE_STATES,
    PART_STATES,
    WORKER_STATES,
    Failure,
    IllegalTransition,
    JobSpec,
    JobState,
    NodeState,
    PartState,
    RunResult,
    StateTable,
    WorkerState,
    assign_workers,
    local_nproc,
    master_ports,
    parse_nnodes,
    parse_nproc,
    worker_env,
)
from elasticd.errors import InvalidSpec

S = JobState


def spec(**kw):
    base = dict(
        id="j-1",
        argv=("train.py",),
        python="/usr/bin/python3",
        workdir="/w",
        uid=1000,
        gid=1000,
        user="alice",
    )
    base.update(kw)
    return JobSpec(**base)


P = PartState
W = WorkerState
N = NodeState


@pytest.mark.parametrize(
    "table, old, new, legal",
    [
        # jobs: a job that ran never goes back to waiting for its first round; an end is final
        (JOB_STATES, None, S.PENDING, True),
        (JOB_STATES, S.PENDING, S.RENDEZVOUS, True),
        (JOB_STATES, S.PENDING, S.RESTARTING, True),  # a daemon that started while it restarted
        (JOB_STATES, S.RENDEZVOUS, S.PENDING, True),  # its only joiner left before the round
        (JOB_STATES, S.RENDEZVOUS, S.RUNNING, True),
        (JOB_STATES, S.RUNNING, S.RESTARTING, True),
        (JOB_STATES, S.RESTARTING, S.RUNNING, True),
        (JOB_STATES, S.RUNNING, S.SUCCEEDED, True),
        (JOB_STATES, S.PENDING, S.CANCELLED, True),
        (JOB_STATES, S.CANCELLED, S.CANCELLED, True),
        (JOB_STATES, S.RUNNING, S.PENDING, False),
        (JOB_STATES, S.RUNNING, S.RENDEZVOUS, False),
        (JOB_STATES, S.RESTARTING, S.PENDING, False),
        (JOB_STATES, S.SUCCEEDED, S.RUNNING, False),
        (JOB_STATES, S.FAILED, S.CANCELLED, False),
        # a node's part, as its agent reports it
        (PART_STATES, None, P.RENDEZVOUS, True),
        (PART_STATES, P.RENDEZVOUS, P.RUNNING, True),
        (PART_STATES, P.RUNNING, P.RESTARTING, True),
        (PART_STATES, P.RESTARTING, P.RUNNING, True),
        (PART_STATES, P.RUNNING, P.BARRIER, True),
        (PART_STATES, P.BARRIER, P.SUCCEEDED, True),
        (PART_STATES, P.BARRIER, P.RESTARTING, True),  # a failure elsewhere sends it back to work
        (PART_STATES, P.RENDEZVOUS, P.LEFT, True),
        (PART_STATES, P.RUNNING, P.FAILED, True),
        (PART_STATES, P.RUNNING, P.SUCCEEDED, True),  # the last one at the exit barrier
        (PART_STATES, P.RENDEZVOUS, P.SUCCEEDED, False),
        (PART_STATES, P.RENDEZVOUS, P.BARRIER, False),
        (PART_STATES, P.SUCCEEDED, P.RUNNING, False),
        (PART_STATES, P.LEFT, P.RUNNING, False),
        (PART_STATES, P.STOPPED, P.FAILED, False),
        # a worker
        (WORKER_STATES, W.INIT, W.HEALTHY, True),
        (WORKER_STATES, W.INIT, W.FAILED, True),
        (WORKER_STATES, W.HEALTHY, W.STOPPED, True),
        (WORKER_STATES, W.HEALTHY, W.SUCCEEDED, True),
        (WORKER_STATES, W.INIT, W.SUCCEEDED, False),
        (WORKER_STATES, W.FAILED, W.HEALTHY, False),
        (WORKER_STATES, W.SUCCEEDED, W.FAILED, False),
        # a node, as another one sees it
        (NODE_STATES, N.UP, N.DRAINING, True),
        (NODE_STATES, N.DRAINING, N.DRAINED, True),
        (NODE_STATES, N.DRAINED, N.UP, True),
        (NODE_STATES, N.LOST, N.UP, True),
        (NODE_STATES, N.DRAINED, N.DRAINING, False),
    ],
)
def test_state_tables(table, old, new, legal):
    assert table.allows(old, new) is legal
    if legal:
        assert table.check(old, new) is new
    else:
        with pytest.raises(IllegalTransition, match=f"cannot go from {old.value} to {new.value}"):
            table.check(old, new)


def test_a_table_without_a_row_for_every_state_is_refused():
    with pytest.raises(ValueError, match="no row for STOPPED"):
        StateTable("a worker", {w: () for w in W if w is not W.STOPPED})


@pytest.mark.parametrize(
    "text, pair", [("1", (1, 1)), ("2:4", (2, 4)), (3, (3, 3)), ("3:3", (3, 3))]
)
def test_parse_nnodes(text, pair):
    assert parse_nnodes(text) == pair


@pytest.mark.parametrize("text", ["0", "4:2", "a", "1:b", "", "0:1"])
def test_parse_nnodes_rejects(text):
    with pytest.raises(InvalidSpec, match="nnodes"):
        parse_nnodes(text)


@pytest.mark.parametrize(
    "value, out", [(2, 2), ("2", 2), ("gpu", "gpu"), ("cpu", "cpu"), ("auto", "auto")]
)
def test_parse_nproc(value, out):
    assert parse_nproc(value) == out


@pytest.mark.parametrize("value", [0, "0", -1, True, "x", "xpu", "GPU", "\u00b2", " 2"])
def test_parse_nproc_rejects(value):
    with pytest.raises(InvalidSpec, match="must be one of N, gpu, cpu, auto"):
        parse_nproc(value)


@pytest.mark.parametrize(
    "nproc, gpus, cpus, workers",
    [
        (3, 8, 2, 3),
        (3, 0, 2, 3),
        ("gpu", 4, 2, 4),
        ("cpu", 4, 16, 16),
        ("cpu", 0, 2, 2),  # cpu: every CPU, GPUs or not
        ("auto", 4, 16, 4),
        ("auto", 0, 16, 16),  # auto: GPUs if any, else CPUs
    ],
)
def test_local_nproc_resolves_per_node(nproc, gpus, cpus, workers):
    assert local_nproc(nproc, gpus=gpus, cpus=cpus) == workers


@pytest.mark.parametrize(
    "change, words",
    [
        ({"argv": ()}, "argv"),
        ({"argv": ("",)}, "argv"),
        ({"kind": "shell"}, "kind"),
        ({"python": "python3"}, "python"),
        ({"workdir": "rel"}, "workdir"),
        ({"env": {"A=B": "x"}}, "env"),
        ({"env": {"A": 1}}, "env"),
        ({"min_nodes": 3, "max_nodes": 2}, "nnodes"),
        ({"nproc_per_node": 0}, "nproc_per_node"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"join_timeout": "x"}, "join_timeout"),
        ({"join_timeout": 0}, "join_timeout"),
        ({"exit_barrier_timeout": 0}, "exit_barrier_timeout"),
        ({"last_call_timeout": -1}, "last_call_timeout"),
        ({"join_timeout": True}, "join_timeout"),
        ({"nodes": ("",)}, "nodes"),
        # what the wire can carry but no argv, environment or file name can
        ({"argv": ("train.py", "a\0b")}, "argv"),
        ({"env": {"A\0B": "1"}}, "env"),
        ({"env": {"A": "1\0"}}, "env"),
        ({"workdir": "/w\0"}, "workdir"),
        ({"python": "/usr/bin/python3\0"}, "python"),
        ({"name": "evil\ud800"}, "name"),
        ({"argv": ("\udc80.py",)}, "argv"),
        ({"nodes": ("n\ud800",)}, "nodes"),
        ({"name": "x" * 257}, "name"),
        # numbers JSON can carry but no timer or counter should take
        ({"join_timeout": float("inf")}, "join_timeout"),
        ({"join_timeout": float("nan")}, "join_timeout"),
        ({"exit_barrier_timeout": 1e300}, "exit_barrier_timeout"),
        ({"last_call_timeout": 10**400}, "last_call_timeout"),
        ({"max_restarts": 10**100}, "max_restarts"),
        ({"nproc_per_node": 10**6}, "nproc_per_node"),
        ({"min_nodes": 1, "max_nodes": 10**9}, "nnodes"),
        ({"nproc_per_node": "xpu"}, "nproc_per_node must be one of N, gpu, cpu, auto"),
        ({"role": ""}, "role"),
        ({"role": "r" * 65}, "role"),
        ({"role": 3}, "role"),
        ({"role": "a\0b"}, "role"),
        ({"role": "\ud800"}, "role"),
        ({"master_port": -1}, "master_port"),
        ({"master_port": 65536}, "master_port"),
        ({"master_port": "29500"}, "master_port"),
        ({"master_port": True}, "master_port"),
        ({"master_port": 65535, "in_place": True}, "the port and the one after it"),
    ],
)
def test_spec_validation(change, words):
    with pytest.raises(InvalidSpec, match=words):
        spec(**change)


def test_control_characters_in_a_name_are_kept_for_the_client_to_escape():
    assert spec(name="evil\x1b]0;x\x07\r\n").name == "evil\x1b]0;x\x07\r\n"


def test_exec_kind_needs_no_python():
    assert spec(kind="exec", python="", argv=("/bin/true", "-x")).command() == ["/bin/true", "-x"]


def test_commands():
    assert spec(argv=("t.py", "--lr", "1")).command() == ["/usr/bin/python3", "t.py", "--lr", "1"]
    assert spec(kind="module", argv=("pkg.train",)).command() == [
        "/usr/bin/python3",
        "-m",
        "pkg.train",
    ]


def test_spec_json_round_trip_and_schema():
    s = spec(env={"A": "1"}, nodes=("n1",), nproc_per_node="gpu", min_nodes=2, max_nodes=4)
    assert JobSpec.from_json(s.to_json()) == s
    doc = s.to_json()
    doc["schema"] = 99
    with pytest.raises(InvalidSpec, match="schema"):
        JobSpec.from_json(doc)
    doc = s.to_json()
    doc["surprise"] = 1
    with pytest.raises(InvalidSpec, match="malformed"):
        JobSpec.from_json(doc)


def test_role_and_master_port_round_trip_and_are_left_out_at_their_default():
    s = spec(role="trainer", master_port=29555, nproc_per_node="cpu")
    assert s.to_json()["role"] == "trainer" and s.to_json()["master_port"] == 29555
    assert JobSpec.from_json(s.to_json()) == s
    plain = spec(role="default", master_port=0).to_json()
    assert (
        "role" not in plain and "master_port" not in plain
    )  # a daemon of the last version reads it
    assert JobSpec.from_json(plain) == spec()
    assert spec(role="r" * 64, master_port=65535).master_port == 65535


def test_in_place_a_fixed_master_port_offers_the_port_after_it_too():
    """The survivors of a round stay in its store while the next round forms."""
    assert master_ports(spec()) == () and master_ports(spec(in_place=True)) == ()
    assert master_ports(spec(master_port=29555)) == (29555,)
    assert master_ports(spec(master_port=29555, in_place=True)) == (29555, 29556)


def test_rank_assignment_heterogeneous():
    group = assign_workers(
        "j",
        "n2",
        round=3,
        restart_count=1,
        group_rank=1,
        group_world_size=3,
        rank_base=4,
        world_size=9,
        nproc=2,
        master_addr="10.0.0.1",
        master_port=29500,
    )
    assert [(w.local_rank, w.rank, w.world_size) for w in group.workers] == [(0, 4, 9), (1, 5, 9)]
    assert group.local_world_size == 2


def test_worker_env_is_torchruns():
    s = spec(env={"PATH": "/bin", "HOME": "/home/alice"}, max_restarts=3)
    group = assign_workers(
        "j-1",
        "n1",
        round=2,
        restart_count=1,
        group_rank=1,
        group_world_size=2,
        rank_base=2,
        world_size=4,
        nproc=2,
        master_addr="10.0.0.1",
        master_port=29500,
        gpus=("2", "3"),
    )
    env = worker_env(s, group, group.workers[1], error_file="/e.json")
    assert {k: env[k] for k in env if k not in ("PATH", "HOME")} == {
        "LOCAL_RANK": "1",
        "RANK": "3",
        "GROUP_RANK": "1",
        "ROLE_RANK": "3",
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "4",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RUN_ID": "j-1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": "/e.json",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "1",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "CUDA_VISIBLE_DEVICES": "2,3",
    }
    assert env["PATH"] == "/bin"


@pytest.mark.parametrize(
    "in_place, user_env, handling",
    [(False, {}, "1"), (True, {}, "2"), (True, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, "1")],
)
def test_nccl_error_handling_keeps_an_in_place_survivor_alive(in_place, user_env, handling):
    """torchrun's 1 (TearDown) ends a process whose NCCL peer died; in place it must live on."""
    s = spec(env=user_env, in_place=in_place)
    group = assign_workers(
        "j-1",
        "n1",
        round=0,
        restart_count=0,
        group_rank=0,
        group_world_size=1,
        rank_base=0,
        world_size=1,
        nproc=1,
        master_addr="a",
        master_port=1,
    )
    assert (
        worker_env(s, group, group.workers[0], error_file="/e")["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
        == handling
    )


@pytest.mark.parametrize(
    "nproc, user_env, omp", [(1, {}, None), (2, {}, "1"), (2, {"OMP_NUM_THREADS": "4"}, "4")]
)
def test_omp_num_threads(nproc, user_env, omp):
    group = assign_workers(
        "j",
        "n",
        round=0,
        restart_count=0,
        group_rank=0,
        group_world_size=1,
        rank_base=0,
        world_size=nproc,
        nproc=nproc,
        master_addr="a",
        master_port=1,
    )
    env = worker_env(spec(env=user_env), group, group.workers[0], error_file="e")
    assert env.get("OMP_NUM_THREADS") == omp
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_worker_env_role_and_cpu_workers():
    group = assign_workers(
        "j",
        "n",
        round=0,
        restart_count=0,
        group_rank=0,
        group_world_size=1,
        rank_base=0,
        world_size=2,
        nproc=2,
        master_addr="a",
        master_port=1,
    )
    env = worker_env(
        spec(role="trainer", nproc_per_node="cpu", env={"CUDA_VISIBLE_DEVICES": "0"}),
        group,
        group.workers[1],
        error_file="e",
    )
    assert env["ROLE_NAME"] == "trainer"
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # the node's GPUs are not a cpu job's


def test_root_cause_is_the_first_failure():
    late = Failure(rank=0, local_rank=0, node="a", exit_code=1, message="late", timestamp=20.0)
    early = Failure(rank=3, local_rank=1, node="b", exit_code=2, message="early", timestamp=10.0)
    assert RunResult(WorkerState.FAILED, (late, early)).root_cause is early
    assert RunResult(WorkerState.SUCCEEDED).root_cause is None
