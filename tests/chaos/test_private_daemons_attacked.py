"""The attackers against elasticrun's private daemons (docs/security.md, "elasticrun's
private daemons"): a job given no key runs "as torchrun does", so anyone who reaches its
store port may join and disturb it; they must get no more than with torchrun.

- Anyone who reaches the store port, with the key anyone can derive from the run id and
  elasticd's own code: reads no argument of the job's command line nor its environment,
  and cannot make a node run anything else: a job of their own published on the board, and
  the job's own record rewritten, run nothing (no file appears), and the job ends 0.
- A local user: cannot reach a private daemon's socket or read its job file (the user's
  0700 directory), and cannot make one use a directory it planted (refused, saying so).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import FIXTURES, PY, free_port, needs_root, python_for_everyone
from hostwide import remove_tree
from launched import Launched
from local_users import local_users

from elasticctl.private import public_key
from elasticd.core.model import JobSpec
from elasticd.jobs.board import JobBoard
from elasticd.store.signing import Signer
from elasticd.store.tcpstore import TCPStoreClient

pytestmark = pytest.mark.slow

ELASTICRUN = os.path.join(os.path.dirname(PY), "elasticrun")
TRAIN = str(FIXTURES / "launch_train.py")
SECRET_ENV, SECRET_ARG = "hunter2-env-s3cret", "hunter3-arg-s3cret"


@pytest.fixture
def tmpdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="erun-", dir="/tmp")
    os.chmod(path, 0o1777)  # as /tmp is: anyone may make a directory there
    yield path
    remove_tree(path)


def line(port: int, run_id: str, index: int) -> list[str]:
    return [
        ELASTICRUN,
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "--local-addr",
        f"127.0.0.{index}",
        TRAIN,
        "--steps",
        "60",
        "--step-seconds",
        "0.25",
        "--note",
        SECRET_ARG,
    ]


async def attack(port: int, run_id: str, planted: Path) -> dict[str, object]:
    """What a client of the store port does with the key anyone can derive: read the job,
    publish a job of its own, rewrite the job's record with another command."""
    cluster = f"elasticrun-{run_id}"
    signer = Signer(public_key(run_id), cluster)
    store = TCPStoreClient(f"127.0.0.1:{port}", timeout=10)
    await store.connect(10)
    try:
        root = f"elasticd/{cluster}"
        claim = signer.open(f"{root}/elasticrun/claim", await store.get(f"{root}/elasticrun/claim"))
        job = claim.body["job"]
        spec_key = f"{root}/jobs/spec/{job}"
        raw = await store.get(spec_key)
        record = signer.open(spec_key, raw).body
        board = JobBoard(store, signer, cluster)
        theirs = JobSpec.from_json(record["spec"])
        command = ("/bin/sh", "-c", f"touch {planted}")
        forged = dataclasses.replace(
            theirs, id="j-badbad", argv=command, kind="exec", min_nodes=1, max_nodes=1
        )
        await board.publish_spec(forged)
        await board.publish_spec(dataclasses.replace(theirs, argv=command, kind="exec"))
        return {"raw": raw, "spec": record["spec"]}
    finally:
        await store.close()


@needs_root
def test_anyone_who_reaches_a_keyless_jobs_store_reads_no_secret_and_runs_nothing(tmpdir):
    port, run_id = free_port(), f"chaos{uuid.uuid4().hex[:6]}"
    planted = Path(tmpdir) / "PWNED"
    env = {
        **{k: v for k, v in os.environ.items() if k != "ELASTICD_SOCKET"},
        "TMPDIR": tmpdir,
        "VIRTUAL_ENV": sys.prefix,
        "SECRET_TOKEN": SECRET_ENV,
        "PET_PRIVATE": "1",
    }
    nodes = [Launched(line(port, run_id, i), env, tmpdir, f"n{i}") for i in (1, 2)]
    for node in nodes:
        node.wait_line(r"^start rank \d world 2 ", timeout=240)
    rank_0 = next(node for node in nodes if "start rank 0 " in node.text())
    rank_0.wait_line(r"^step 5 world 2$", timeout=240)
    seen = asyncio.run(attack(port, run_id, planted))
    assert SECRET_ENV.encode() not in seen["raw"] and SECRET_ARG.encode() not in seen["raw"]
    assert seen["spec"]["env"] == {} and seen["spec"]["argv"] == [TRAIN]
    for node in nodes:
        assert node.wait(300) == 0, node.story("exit")
    for node in nodes:
        node.wait_line(r"warning: no key for this job", "err", timeout=1)
    assert not planted.exists()  # neither the forged job nor the rewritten record ran
    refusals = [
        node.text("err") for node in nodes if "private daemon runs job j-" in node.text("err")
    ]
    assert refusals, "a node took the forged job up, and would not start it"


@needs_root
def test_a_local_user_cannot_reach_a_private_daemon_or_plant_its_directory(tmpdir):
    with local_users("victim") as users:
        import pwd

        victim = pwd.getpwnam(users["victim"])
        python = f"{python_for_everyone()}/bin/python3"
        code = "import sys; from elasticctl.cli import elasticrun; sys.exit(elasticrun())"
        env = {
            "PATH": f"{python_for_everyone()}/bin:/usr/bin:/bin",
            "HOME": tmpdir,
            "TMPDIR": tmpdir,
            "VIRTUAL_ENV": python_for_everyone(),
        }
        as_victim = [
            "setpriv",
            f"--reuid={victim.pw_uid}",
            f"--regid={victim.pw_gid}",
            "--clear-groups",
            "--",
        ]
        as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
        node = Launched(
            [*as_victim, python, "-c", code, "--private", *line(free_port(), "v", 1)[1:]],
            env,
            tmpdir,
            "victim",
        )
        try:
            told = node.wait_line(r"elasticctl --socket (\S+) status (j-[0-9a-f]+)", "err", 120)
            sock, job = told.group(1), told.group(2)
            directory = Path(sock).parent.parent
            for argv in (
                [python, "-m", "elasticctl", "--socket", sock, "status", job],
                ["cat", str(directory / "job.json")],
                ["ls", str(directory)],
            ):
                done = subprocess.run([*as_nobody, *argv], capture_output=True, text=True, env=env)
                assert done.returncode != 0 and "denied" in done.stderr.lower(), (argv, done)
        finally:
            node.kill_tree()
        # a directory planted where the victim's elasticrun keeps its daemons' is refused
        base = Path(tmpdir) / f"elasticrun-{victim.pw_uid}"
        remove_tree(base)
        subprocess.run([*as_nobody, "mkdir", "-m", "0777", str(base)], check=True)
        refused = Launched(
            [*as_victim, python, "-c", code, "--private", TRAIN], env, tmpdir, "victim"
        )
        assert refused.wait(60) == 1, refused.story("exit")
        refused.wait_line(rf"refusing {base}: it must be a directory of yours", "err", timeout=1)
