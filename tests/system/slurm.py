"""A real Slurm cluster on network-namespace test hosts (Debian's slurm-wlm 22.05: slurmctld,
slurmd, munge), made and torn down by a test: everything it writes is under the test's
directory, and nothing of this machine's own Slurm or munge is used.

- munged runs in the root namespace with its own key and socket (a Unix socket: no
  packet), named in slurm.conf (``AuthInfo=socket=...``);
- slurmctld runs on host 1, one slurmd per host, each with the host's name (``on_host``:
  its UTS namespace and /etc/hosts; slurmd finds its node by the host name);
- processes are tracked by Slurm's linuxproc plugin (no cgroups), nothing is accounted;
- clients (sbatch, srun, sinfo) find the cluster by ``SLURM_CONF``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import psutil
from user_nodes import host_name, on_host

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo")


def usable() -> str | None:
    """Why a Slurm cluster cannot be made here, or None."""
    missing = [name for name in PROGRAMS if shutil.which(name) is None]
    if missing:
        return f"needs {', '.join(missing)} (apt-get install slurmd slurmctld slurm-client munge)"
    return None


class SlurmCluster:
    def __init__(self, hosts: object, base: Path, name: str) -> None:
        self.hosts = hosts
        self.base = base
        self.name = name
        self.count = hosts.count  # type: ignore[attr-defined]
        self.conf = base / "slurm.conf"
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> SlurmCluster:
        """munged first (it forks once it serves: its start returns then), then slurmctld
        and the slurmds; a job submitted meanwhile waits in the queue until its nodes
        registered."""
        munge = self.base / "munge"
        munge.mkdir(mode=0o711)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        socket_path = munge / "munge.sock"
        self.munged_pid = munge / "munged.pid"
        subprocess.run(
            [
                "munged",
                "--force",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--log-file={munge / 'munged.log'}",
                f"--pid-file={self.munged_pid}",
                f"--seed-file={munge / 'seed'}",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        (self.base / "ctld").mkdir()
        for i in range(1, self.count + 1):
            (self.base / f"spool-{host_name(i)}").mkdir()
        self.conf.write_text(self._config(socket_path))
        self._spawn(on_host(self.hosts, 1, ["slurmctld", "-D", "-f", str(self.conf)]), "slurmctld")
        for i in range(1, self.count + 1):
            argv = on_host(self.hosts, i, ["slurmd", "-D", "-f", str(self.conf)])
            self._spawn(argv, f"slurmd-{host_name(i)}")
        return self

    def _config(self, munge_socket: Path) -> str:
        base, cpus = self.base, os.cpu_count() or 1
        nodes = "\n".join(
            f"NodeName={host_name(i)} NodeAddr={self.hosts.addr(i)} CPUs={cpus} State=UNKNOWN"  # type: ignore[attr-defined]
            for i in range(1, self.count + 1)
        )
        return f"""\
ClusterName={self.name}
SlurmctldHost={host_name(1)}({self.hosts.addr(1)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={base}/ctld
SlurmdSpoolDir={base}/spool-%n
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd-%n.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, argv: list[str], name: str) -> None:
        with open(self.base / f"{name}.out", "wb") as out:
            self.procs.append(
                subprocess.Popen(
                    argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, **self.env},
                )
            )

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name} ---\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(self.base.glob("*.log")) + sorted(self.base.glob("*.out"))
        )

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        try:
            pid = int(self.munged_pid.read_text())
        except (AttributeError, OSError, ValueError):
            return
        try:
            munged = psutil.Process(pid)
            munged.terminate()
            munged.wait(30)
        except psutil.NoSuchProcess:
            pass
