"""The elasticd demo: a three-node cluster on this host survives losing a node mid-training.

    examples/demo            (installs what is needed, then runs this)

1. Starts three elasticd daemons as one cluster on this host: node1 (127.0.0.1) hosts the
   store, node2 (127.0.0.2) and node3 (127.0.0.3) join it.  Each has its own state dir,
   control socket and address; each is ready when its sd_notify READY=1 arrives.
2. Submits examples/ddp_train.py with ``--nnodes 2:3`` (one worker per node, checkpoint
   every epoch) and follows its logs: per-epoch loss and world size.
3. After two epochs, kills a node that is neither the store host nor rank 0 with SIGKILL.
   The survivors notice by heartbeat, re-form with world size 2, resume from the last
   checkpoint and finish.
4. Stops the daemons (SIGTERM) and checks that no process it started is left.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
EPOCH = re.compile(r"epoch (\d+) loss [\d.]+ world_size (\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    def __init__(self, work: Path, index: int, store_port: int, key: str) -> None:
        self.name = f"node{index}"
        self.dir = work / self.name
        self.dir.mkdir()
        self.socket = str(self.dir / "control.sock")
        self.args = [
            str(BIN / "elasticd"),
            "--cluster",
            "demo",
            "--store",
            f"127.0.0.1:{store_port}",
            "--store-host" if index == 1 else "--no-store-host",
            "--node-name",
            self.name,
            "--node-address",
            f"127.0.0.{index}",
            "--state-dir",
            str(self.dir / "state"),
            "--runtime-dir",
            str(self.dir),
            "--cluster-key",
            key,
            "--slots",
            "1",
            "--metrics-port",
            "0",
            "--config",
            str(work / "demo.toml"),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        ready = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        ready.bind(str(self.dir / "notify.sock"))
        ready.settimeout(120)
        log = open(self.dir / "elasticd.log", "wb")
        env = {**os.environ, "NOTIFY_SOCKET": str(self.dir / "notify.sock")}
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while b"READY=1" not in ready.recv(4096):
                pass
        except TimeoutError:
            sys.exit(f"{self.name} did not become ready; see {self.dir / 'elasticd.log'}")
        finally:
            ready.close()

    def ctl(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(
            [str(BIN / "elasticctl"), "--socket", self.socket, *args],
            capture_output=True,
            text=True,
        )
        if check and done.returncode != 0:
            sys.exit(f"elasticctl {' '.join(args)} failed: {done.stderr}")
        return done.stdout

    def status(self, job: str) -> dict:
        return json.loads(self.ctl("--json", "status", job))


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def run(work: Path, epochs: int) -> int:
    key = str(work / "cluster.key")
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from elasticd.store.signing import create_key; create_key({key!r})",
        ],
        check=True,
    )
    # Jobs of root run as root only where the config says so; this demo's daemons allow it.
    (work / "demo.toml").write_text("[jobs]\nallow_root = true\n")
    port = free_port()
    nodes = [Node(work, i, port, key) for i in (1, 2, 3)]
    workers: set[int] = set()
    try:
        say("starting three daemons: node1 hosts the store, node2 and node3 join it")
        for node in nodes:
            node.start()
        print(nodes[0].ctl("nodes"), end="")

        say(
            f"submitting examples/ddp_train.py --nnodes 2:3 ({epochs} epochs, checkpoint every epoch)"
        )
        job = json.loads(
            nodes[0].ctl(
                "--json",
                "submit",
                "--nnodes",
                "2:3",
                "--name",
                "demo",
                "--python",
                sys.executable,
                str(HERE / "ddp_train.py"),
                "--",
                "--epochs",
                str(epochs),
                "--checkpoint",
                str(work / "checkpoint.pt"),
                "--epoch-seconds",
                "1",
            )
        )["id"]
        print(f"job {job}")
        follow = subprocess.Popen(
            [str(BIN / "elasticctl"), "--socket", nodes[0].socket, "logs", "-f", job],
            stdout=subprocess.PIPE,
            text=True,
        )
        before = after = None
        victim = None
        assert follow.stdout is not None
        for line in follow.stdout:
            if " err] " not in line:  # the workers' stderr: `elasticctl logs` shows it all
                print(line, end="", flush=True)
            progress = EPOCH.search(line)
            if progress is None:
                continue
            epoch, world = int(progress.group(1)), int(progress.group(2))
            if victim is None and epoch >= 1:
                before = world
                status = nodes[0].status(job)
                workers |= {w["pid"] for w in status["workers"] if w["pid"]}
                victim = next(
                    n
                    for n in nodes[1:]
                    for part in status["nodes"]
                    if part["node"] == n.name and part["group_rank"] != 0
                )
                say(f"world size {before}; killing {victim.name} with SIGKILL mid-training")
                assert victim.proc is not None
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait()
            elif victim is not None:
                after = world
        follow.wait()
        status = nodes[0].status(job)
        workers |= {w["pid"] for w in status["workers"] if w["pid"]}
        say(
            f"job {job} {status['state']}: world size {before} before the kill, {after} after; "
            f"{status['restarts']} restarts used (a lost node costs none)"
        )
        return 0 if status["state"] == "SUCCEEDED" and before == 3 and after == 2 else 1
    finally:
        say("stopping the daemons")
        for node in nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in nodes:
            if node.proc is not None:
                node.proc.wait(timeout=60)
        left = [pid for pid in workers if _alive(pid)]
        print("no process left behind" if not left else f"LEFT BEHIND: {left}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="elasticd-demo-"))
    try:
        return run(work, args.epochs)
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
