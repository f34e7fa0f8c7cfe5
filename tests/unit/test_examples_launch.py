"""The command lines that examples/slurm/ and examples/kubernetes/ run (docs/slurm.md): each
parses as elasticrun's line and says, with what Slurm or the pod's DNS name adds, where the
job's nodes meet.  There is no Kubernetes cluster here: this is what can be tested of it
(the Slurm script itself runs in tests/system/test_slurm.py's cluster as its line)."""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from elasticctl import cli, private, submission, topology

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "elasticrun.sbatch"
MANIFEST = ROOT / "examples" / "kubernetes" / "elasticrun-job.yaml"


@pytest.fixture(autouse=True)
def no_own_venv(monkeypatch):
    monkeypatch.setattr(submission, "own_venv_python", lambda: "")


def srun_line() -> list[str]:
    """The script's elasticrun arguments, its own arguments ("$@") being train.py."""
    (line,) = [text for text in SBATCH.read_text().splitlines() if text.startswith("srun ")]
    words = shlex.split(line)
    words = words[words.index("elasticrun") + 1 :]
    return [*words[: words.index("$@")], "train.py", "--epochs", "10"]


def test_the_sbatch_script_asks_for_what_its_line_needs():
    text = SBATCH.read_text()
    assert "#SBATCH --nodes=3" in text and "#SBATCH --ntasks-per-node=1" in text
    assert text.startswith("#!/bin/bash\n")


def test_the_sbatch_line_meets_at_the_steps_first_node_with_slurms_id_and_key():
    environ = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "2",
        "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_NODELIST": "gpu[07-09]",
    }
    args = cli.parse_elasticrun(srun_line(), environ)
    where = topology.resolve(args, environ)
    assert (where.nnodes, where.backend, where.endpoint, where.run_id) == (
        "2:3",
        "c10d",
        "gpu07:29400",
        "77",
    )
    assert (where.slurm_job, where.slurm_first, where.key_file) == ("77", False, "")
    assert (args.nproc_per_node, args.max_restarts, args.script) == ("gpu", 3, "train.py")
    assert args.script_args == ["--epochs", "10"]


def manifest() -> tuple[dict, dict]:
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}
    return docs["Service"], docs["Job"]


def test_the_pods_meet_at_pod_0_through_the_headless_service():
    service, job = manifest()
    name, pod = job["metadata"]["name"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["elasticrun"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert service["spec"]["selector"] == {"job-name": name}  # the Job controller's label
    assert pod["subdomain"] == service["metadata"]["name"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 3
    assert job["spec"]["successPolicy"]["rules"] == [{"succeededIndexes": "0"}]

    args = cli.parse_elasticrun(container["args"], {"HOSTNAME": f"{name}-1"})
    where = topology.resolve(args, {})
    # pod i's name is <job>-<i>; with the subdomain, <job>-0.<service> is pod 0's address
    assert where.host == f"{name}-0.{service['metadata']['name']}"
    assert (where.port, where.backend, where.nnodes) == (29400, "c10d", "2:3")
    assert where.hosts_store is None  # pod 0 finds its own address is the endpoint's
    assert where.run_id == name and where.cluster == f"elasticrun-{name}"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "key")
    assert where.key_file == f"{mount['mountPath']}/key"
    key_volume = next(v for v in pod["volumes"] if v["name"] == "key")
    assert key_volume["secret"]["defaultMode"] == 0o400  # what elasticrun wants of a key
    assert container["ports"] == [{"containerPort": where.port}]


def test_the_private_daemons_config_for_a_pod(tmp_path):
    _, job = manifest()
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args = cli.parse_elasticrun(container["args"], {})
    where = topology.resolve(args, {})
    request = submission.submit_request(args, {"PATH": "/usr/bin"}, "/w", private=True)
    config = tomllib.loads(
        private.daemon_config(request, where, str(tmp_path), "pod-1", "/etc/elasticrun/key", {})
    )
    assert config["store"] == {
        "endpoint": "elasticrun-train-0.elasticrun-train:29400",
        "host": "auto",
        "firewall": False,
        "connect_timeout": 600.0,
    }
    assert config["cluster"] == {
        "name": "elasticrun-elasticrun-train",
        "key_file": "/etc/elasticrun/key",
    }
    assert config["node"]["peer_port"] == 0 and config["metrics"]["port"] == 0
    assert config["scheduler"] == {"enabled": False}
