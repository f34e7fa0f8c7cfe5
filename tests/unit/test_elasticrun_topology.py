"""Where a torchrun line run once per node meets the others (ctl/elasticctl/topology.py),
table by table: torchrun's three forms (c10d, etcd, static), what Slurm fills in when the
line leaves it out, and the lines that cannot say where the store is."""

from __future__ import annotations

import pytest

from elasticctl import cli, submission, topology, torchrun

STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_NNODES": "3",
    "SLURM_STEP_NODELIST": "gpu[07-09]",
    "SLURM_JOB_NODELIST": "gpu[07-09],gpu12",
}
BATCH = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}  # the script itself


@pytest.fixture(autouse=True)
def no_own_venv(monkeypatch):
    monkeypatch.setattr(submission, "own_venv_python", lambda: "")


def where(line: str, environ: dict[str, str] | None = None) -> topology.Topology:
    environ = environ or {}
    return topology.resolve(cli.parse_elasticrun(line.split(), environ), environ)


@pytest.mark.parametrize(
    "line, expected",
    [
        # c10d: the endpoint's node hosts the store (decided there: auto); default port 29400
        (
            "--nnodes 2:4 --rdzv-backend c10d --rdzv-endpoint head:29500 --rdzv-id r1 x.py",
            dict(nnodes="2:4", backend="c10d", host="head", port=29500, run_id="r1"),
        ),
        (
            "--nnodes 2 --rdzv-backend c10d --rdzv-endpoint head x.py",
            dict(backend="c10d", host="head", port=29400, run_id="none", hosts_store=None),
        ),
        # torchrun's is_host says it instead
        (
            "--nnodes 2 --rdzv-backend c10d --rdzv-endpoint head --rdzv-conf is_host=0 x.py",
            dict(hosts_store=False),
        ),
        # an endpoint without a backend: c10d (static would make every node rank 0)
        (
            "--nnodes 2 --rdzv-endpoint [fe80::1]:7 x.py",
            dict(backend="c10d", host="fe80::1", port=7),
        ),
        # etcd: no node hosts anything; torchrun's etcd keys are the store's TLS settings
        (
            "--nnodes 1:3 --rdzv-backend etcd-v2 --rdzv-endpoint etcd:2379 --rdzv-id e "
            "--rdzv-conf protocol=https,cacert=/ca.pem,cert=/c.pem,key=/k.pem x.py",
            dict(
                backend="etcd",
                host="etcd",
                port=2379,
                hosts_store=None,
                etcd_tls={"ca_file": "/ca.pem", "cert_file": "/c.pem", "key_file": "/k.pem"},
            ),
        ),
        ("--nnodes 2 --rdzv-backend etcd --rdzv-endpoint etcd x.py", dict(port=2379)),
        # static, torchrun's default backend: node rank 0 hosts at --master-addr:--master-port
        (
            "--nnodes 2 --node-rank 0 --master-addr m1 --master-port 23456 x.py",
            dict(backend="static", host="m1", port=23456, hosts_store=True),
        ),
        (
            "--nnodes 2 --node-rank 1 --master-addr m1 x.py",
            dict(backend="static", host="m1", port=29500, hosts_store=False),
        ),
        # the job's key and this node's address
        (
            "--nnodes 2 --rdzv-endpoint h --local-addr 10.0.0.7 --rdzv-conf key_file=~/k x.py",
            dict(local_addr="10.0.0.7", key_file="~/k"),
        ),
        # one node: nothing to meet (a daemon without a store port)
        ("--rdzv-backend c10d --rdzv-endpoint localhost:0 x.py", dict(backend="", nnodes="1:1")),
        ("--standalone --nproc-per-node 4 x.py", dict(backend="")),
    ],
)
def test_torchruns_forms(line, expected):
    found = where(line)
    assert {key: getattr(found, key) for key in expected} == expected


def test_the_private_cluster_is_named_after_the_rendezvous_id():
    assert where("--nnodes 2 --rdzv-endpoint h --rdzv-id job-7 x.py").cluster == "elasticrun-job-7"
    odd = where("--nnodes 2 --rdzv-endpoint h --rdzv-id a/b:c x.py").cluster
    assert odd.startswith("elasticrun-") and len(odd) == len("elasticrun-") + 16
    assert odd == where("--nnodes 2 --rdzv-endpoint h --rdzv-id a/b:c x.py").cluster


@pytest.mark.parametrize(
    "line, environ, expected",
    [
        # inside a step, what the line leaves out is Slurm's
        (
            "--nproc-per-node 8 x.py",
            STEP,
            dict(
                nnodes="3",
                backend="c10d",
                host="gpu07",
                port=29400,
                run_id="4242",
                slurm_job="4242",
                slurm_first=False,
                from_slurm=("--nnodes 3", "--rdzv-id 4242", "--rdzv-endpoint gpu07:29400"),
            ),
        ),
        # what the line says wins
        (
            "--nnodes 2:3 --rdzv-id mine --rdzv-endpoint head:1234 x.py",
            STEP,
            dict(nnodes="2:3", host="head", port=1234, run_id="mine", from_slurm=()),
        ),
        ("--nnodes 2:3 x.py", {**STEP, "SLURM_PROCID": "0"}, dict(slurm_first=True)),
        # the batch script is no step: it runs once, so it is a one-node job there
        ("--nproc-per-node 8 x.py", BATCH, dict(backend="", nnodes="1:1", slurm_job="")),
        # a one-node step
        ("x.py", {**STEP, "SLURM_STEP_NUM_NODES": "1"}, dict(backend="")),
        # the static form keeps its own endpoint
        (
            "--nnodes 3 --node-rank 2 --master-addr m x.py",
            STEP,
            dict(backend="static", host="m", hosts_store=False, run_id="4242"),
        ),
    ],
)
def test_slurm_says_what_the_line_leaves_out(line, environ, expected):
    found = where(line, environ)
    assert {key: getattr(found, key) for key in expected} == expected


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("gpu[07-09,12],cpu3", "gpu07"),
        ("r[1-2]-n[4-5]", "r1-n4"),
        ("single", "single"),
        ("a1,a2", "a1"),
        ("n[3]", "n3"),
        ("n[010-012]x", "n010x"),
    ],
)
def test_the_first_host_of_a_slurm_host_list(nodelist, first):
    assert topology.first_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["", "n[1-3", "[]"])
def test_a_host_list_that_is_none(nodelist):
    with pytest.raises(torchrun.TorchrunError, match="not a Slurm host list"):
        topology.first_host(nodelist)


@pytest.mark.parametrize(
    "line, words",
    [
        ("--nnodes 2 --rdzv-backend c10d x.py", "--rdzv-endpoint HOST[:PORT] is needed"),
        ("--nnodes 2 --rdzv-backend etcd x.py", "the etcd member to use"),
        ("--nnodes 2 --rdzv-backend zookeeper --rdzv-endpoint z x.py", "c10d (a store"),
        ("--nnodes 2 --rdzv-endpoint h:x x.py", "expected HOST[:PORT]"),
        ("--nnodes 2 --rdzv-endpoint h:70000 x.py", "expected HOST[:PORT]"),
        ("--nnodes 2 --rdzv-endpoint h --rdzv-conf is_host=maybe x.py", "expected true or false"),
        (
            "--nnodes 2 --rdzv-backend etcd --rdzv-endpoint e --rdzv-conf protocol=https x.py",
            "needs cacert=FILE",
        ),
        ("--nnodes 2 --rdzv-endpoint h --rdzv-conf frob=1 x.py", "means nothing under elasticd"),
    ],
)
def test_lines_that_cannot_say_where_the_store_is(line, words):
    with pytest.raises(torchrun.TorchrunError) as info:
        where(line)
    assert words in str(info.value)


def test_launcher_topology_goes_to_the_private_daemons_not_refused():
    args = cli.parse_elasticrun(
        "--nnodes 2:3 --rdzv-backend c10d --rdzv-endpoint h --rdzv-id r --local-addr a x.py".split(),
        {},
    )
    request = submission.submit_request(args, {"PATH": "/usr/bin"}, "/w", private=True)
    assert request["nnodes"] == "2:3" and request["argv"] == ["x.py"]
    with pytest.raises(submission.UsageError, match="elasticrun --private"):
        submission.submit_request(args, {"PATH": "/usr/bin"}, "/w")  # to a daemon: refused
    standalone = cli.parse_elasticrun("--nnodes 2 --standalone x.py".split(), {})
    with pytest.raises(submission.UsageError, match="--standalone: a one-node job"):
        submission.submit_request(standalone, {"PATH": "/usr/bin"}, "/w", private=True)


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"PET_IN_PLACE": "1", "PET_SPARES": "2"}, dict(in_place=True, spares=2)),
        ({"PET_PRIVATE": "1", "PET_REJOIN_TIMEOUT": "30"}, dict(private=True, rejoin_timeout=30)),
        ({"PET_IN_PLACE": "0"}, dict(in_place=False)),
        ({"PET_WARM_RESTART": "1"}, dict(warm_restart=True)),
    ],
)
def test_elasticruns_own_options_are_read_from_pet_too(environ, expected):
    args = cli.parse_elasticrun(["x.py"], environ)
    assert {key: getattr(args, key) for key in expected} == expected


def test_the_command_line_wins_over_pet_and_bad_pet_values_are_refused():
    assert cli.parse_elasticrun(["--spares", "3", "x.py"], {"PET_SPARES": "1"}).spares == 3
    with pytest.raises(torchrun.TorchrunError, match="PET_IN_PLACE='yes': expected 0 or 1"):
        cli.parse_elasticrun(["x.py"], {"PET_IN_PLACE": "yes"})
    with pytest.raises(torchrun.TorchrunError, match="PET_SPARES='many'"):
        cli.parse_elasticrun(["x.py"], {"PET_SPARES": "many"})
