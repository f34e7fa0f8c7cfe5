"""README.md's "A five-minute tour", run as written (a new user's first hour; docs/getting-started.md
shows the same block, taken from README.md).

The ``$ `` lines of the tour's code block go, verbatim and in order, to one ``bash`` reading
them from a pipe (so ``&`` and ``export`` behave as they do for a user), with the working
directory at the checkout's root, no ``VIRTUAL_ENV`` and a PATH without the venv: the tour's
own ``export`` line puts ``.venv/bin`` first, the venv never activated.  The venv is the one
``packaging/venv.sh`` made (a fresh clone's: ``.ci/run`` makes it so), and the tour's first line
runs that script again (a no-op once its stamp is current).

Isolation: the tour runs as root, inside private mount, network and UTS namespaces.
*   Not as ``nobody`` with a private HOME: a checkout's venv is a link to the interpreter it
    was made with, often under /root (pyenv here), which no other user can execute; and the
    tour's user is root, whose daemon keeps its state in /var/lib/elasticd and its socket in
    /run/elasticd and runs root's jobs as root (a ``--standalone`` daemon's allow_root).
*   The mount namespace keeps those two off the host: /run is a fresh tmpfs, /var/lib an
    overlay whose upper layer is a tmpfs of its own (the host's /var/lib/elasticd, if any, is
    hidden).  /etc/hosts is a copy that also names the namespace's host, and host names come
    from it alone (no DNS server answers inside: a lookup that times out would make c10d
    warn in every worker's stderr).
*   The UTS namespace gives the daemon a node name of its own (``tour<pid>``, its default node
    name is the hostname): a root daemon makes a cgroup ``elasticd-<node>`` on the host's
    cgroup tree and kills what it finds left there at start, so two root daemons named after
    the same host would kill each other's jobs.
*   The network namespace (only ``lo``) gives the daemon the README's metrics port 9464 even
    when a daemon on the host holds it, so the ``curl`` line never needs a skip, and nothing
    the tour starts listens on the host's network.
Every process the tour starts is in the mount namespace; after the daemon's SIGTERM none is
left there but the shell.

Besides the README's sample output (its lines, in order; job ids, losses and ages may differ),
the test checks that the venv's ``import torch`` prints no NumPy warning and that no worker's
stderr has one (examples/ddp_train.py does not filter it; tests/fixtures/worker.py does).

Substitutions, the only lines not run exactly as printed: a job id shown in the README's
output of a ``submit`` (``job j-1b17f5 submitted ...``) stands for the id that submit really
printed, in every later line (``elasticctl logs j-1b17f5`` runs with the real id).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from harness import ROOT, needs_root

pytestmark = [pytest.mark.root, pytest.mark.slow, needs_root]

README = ROOT / "README.md"
VENV = ROOT / ".venv"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NUMPY_WARNING = "Failed to initialize NumPy"
SUBMITTED = re.compile(r"\bjob (j-[0-9a-z]+) submitted\b")


@dataclass
class Step:
    """One ``$ `` line of the tour and the output the README shows under it."""

    command: str
    shown: list[str] = field(default_factory=list)


def tour_steps(readme: str) -> list[Step]:
    """The ``$ `` lines of the first code block under "## A five-minute tour"."""
    section = readme.split("\n## A five-minute tour", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```[^\n]*\n(.*?)^```", section, re.S | re.M)
    assert block, "no code block in the README's tour"
    steps: list[Step] = []
    for line in block.group(1).splitlines():
        if line.startswith("$ "):
            steps.append(Step(line[2:]))
        elif steps:
            steps[-1].shown.append(line)
    return steps


def command_words(command: str) -> str:
    """The command without its trailing ``# comment`` (for recognising it, not running it)."""
    return re.sub(r"\s+#.*$", "", command).strip()


class Shell:
    """One non-interactive bash fed line by line; each command's stdout, stderr and exit
    code are cut out of the streams by a random marker written after it."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=str(cwd),
        )
        self.token = f"@@tour-{secrets.token_hex(8)}"
        self.out = bytearray()
        self.err = bytearray()
        self.cond = threading.Condition()
        self.eof = 0
        self.pumps = [
            threading.Thread(target=self._pump, args=(s, b), daemon=True)
            for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for pump in self.pumps:
            pump.start()
        self.count = 0
        self.transcript: list[str] = []

    def _pump(self, stream, into: bytearray) -> None:
        while chunk := os.read(stream.fileno(), 65536):
            with self.cond:
                into.extend(chunk)
                self.cond.notify_all()
        with self.cond:
            self.eof += 1
            self.cond.notify_all()

    def run(self, command: str, timeout: float = 300.0) -> tuple[int, str, str]:
        """Run one command line in the shell; (exit code, stdout, stderr)."""
        self.count += 1
        mark = f"{self.token}-{self.count}"
        with self.cond:
            out_from, err_from = len(self.out), len(self.err)
        script = (
            f"{command}\n"
            f"__tour_rc=$?; printf '\\n%s %d\\n' '{mark}' \"$__tour_rc\"; "
            f"printf '\\n%s\\n' '{mark}' >&2\n"
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(script.encode())
        self.proc.stdin.flush()
        pattern = re.compile(rb"\n" + re.escape(mark.encode()) + rb" (\d+)\n")
        err_mark = b"\n" + mark.encode() + b"\n"
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = pattern.search(self.out, out_from)
                err_at = self.err.find(err_mark, err_from)
                if found and err_at >= 0:
                    break
                left = deadline - time.monotonic()
                if left <= 0 or self.eof == 2:
                    raise AssertionError(
                        f"`{command}` did not finish in {timeout:.0f} s (or the "
                        f"shell ended)\n{self.text()}"
                    )
                self.cond.wait(left)
            out = self.out[out_from : found.start()].decode(errors="replace")
            err = self.err[err_from:err_at].decode(errors="replace")
        code = int(found.group(1))
        self.transcript.append(f"$ {command}\n{out}{err}[exit {code}]")
        return code, out, err

    def text(self) -> str:
        with self.cond:
            err = self.err.decode(errors="replace")
        err = "\n".join(line for line in err.splitlines() if line and self.token not in line)
        return (
            "\n".join(self.transcript)
            + "\n--- the shell's stderr (the daemon's log too) ---\n"
            + err[-8000:]
        )

    def close(self, timeout: float = 30.0) -> int:
        assert self.proc.stdin is not None
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def namespace_argv(base: Path, hostname: str) -> list[str]:
    """bash in fresh mount, network and UTS namespaces (see the module docstring), after the
    set-up, with `exec` so that the shell is the namespaces' first process."""
    layer = base / "varlib"
    layer.mkdir()
    hosts = base / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text() + f"\n127.0.0.1 {hostname}\n")
    # Host names from /etc/hosts alone (see the module docstring).
    nsswitch = base / "nsswitch.conf"
    system = Path("/etc/nsswitch.conf")
    nsswitch.write_text(
        re.sub(r"(?m)^hosts:.*$", "hosts: files", system.read_text() if system.exists() else "")
    )
    setup = "\n".join(
        [
            "set -e",
            f"hostname {hostname}",
            "ip link set lo up",
            f"mount --bind {hosts} /etc/hosts",
            f"mount --bind {nsswitch} {system}" if system.exists() else "true",
            "mount -t tmpfs -o mode=0755 tour-run /run",
            f"mount -t tmpfs -o mode=0700 tour-varlib {layer}",  # (an upper layer on overlayfs fails)
            f"mkdir {layer}/upper {layer}/work",
            f"mount -t overlay tour-varlib -o lowerdir=/var/lib,upperdir={layer}/upper,"
            f"workdir={layer}/work /var/lib",
            "rm -rf /var/lib/elasticd",  # a whiteout in our upper layer: the host's stays
            "set +e",
            "exec bash --noprofile --norc",
        ]
    )
    return [
        "unshare",
        "--mount",
        "--net",
        "--uts",
        "--propagation",
        "private",
        "--",
        "bash",
        "--noprofile",
        "--norc",
        "-c",
        setup,
    ]


def shown_pattern(line: str, ids: dict[str, str]) -> re.Pattern[str]:
    """A line the README shows as a pattern for the real one: its job ids stand for the real
    ids, a number with a decimal point (a loss) and an age (``4s ago``) may differ, and a run
    of spaces (a column's padding) may have any width."""
    pieces = re.split(r"(\bj-[0-9a-z]+\b|\d+\.\d+|\b\d+s ago\b| {2,})", line)
    out = []
    for i, piece in enumerate(pieces):
        if not i % 2:
            out.append(re.escape(piece))
        elif piece in ids:
            out.append(re.escape(ids[piece]))
        elif piece.startswith("j-"):
            raise AssertionError(f"the README shows {piece}, which no submit above it printed")
        elif piece.endswith(" ago"):
            out.append(r"\d+[smhd] ago")
        elif piece.startswith(" "):
            out.append(r" {2,}")
        else:
            out.append(r"\d+\.\d+")
    return re.compile("^" + "".join(out) + "$", re.M)


def assert_shown(step: Step, out: str, ids: dict[str, str], transcript: str) -> None:
    """Every line the README shows under ``step`` (but ``...``) is printed, in that order."""
    at = 0
    for line in step.shown:
        if line.strip() == "...":
            continue
        found = shown_pattern(line, ids).search(out, at)
        assert found, f"`{step.command}`: no line like {line!r} (in order)\n{transcript}"
        at = found.end()


def in_namespace(shell: int) -> list[int]:
    """The processes in ``shell``'s mount namespace but ``shell`` itself."""
    ours = os.readlink(f"/proc/{shell}/ns/mnt")
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != shell:
            try:
                if os.readlink(f"/proc/{entry}/ns/mnt") == ours:
                    found.append(int(entry))
            except OSError:
                pass  # gone meanwhile
    return found


def describe(pids: list[int]) -> str:
    lines = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        lines.append(f"{pid}: {argv.decode(errors='replace')}")
    return "\n".join(lines)


def remove_cgroups(node: str) -> list[str]:
    """Remove what is left of the cgroups ``elasticd-<node>-<digest>`` that a root daemon
    named ``node`` makes in its own cgroup (this process's: v2, and v1 memory and pids on a
    hybrid host); returns those it could not remove."""
    made = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            mounts = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        elif {"memory", "pids"} & set(controllers.split(",")):
            mounts = [
                f"/sys/fs/cgroup/{c}" for c in ("memory", "pids") if c in controllers.split(",")
            ]
        else:
            continue
        made += [
            c
            for mount in mounts
            for c in Path(mount + path.rstrip("/")).glob(f"elasticd-{node}-??????")
        ]
    stuck = []
    for cgroup in (c for c in made if c.is_dir()):
        for child in sorted((p for p in cgroup.rglob("*") if p.is_dir()), reverse=True) + [cgroup]:
            try:
                child.rmdir()
            except OSError:
                stuck.append(str(child))
    return stuck


@pytest.fixture
def tour_dir() -> Iterator[Path]:
    path = Path(f"/tmp/elasticd-tour-{os.getpid()}-{secrets.token_hex(3)}")
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_readme_tour_runs_as_written(tour_dir: Path) -> None:
    if not (VENV / "bin" / "python3").exists():
        pytest.skip(f"no {VENV}: make it with packaging/venv.sh (tests/run does)")
    missing = [
        tool
        for tool in ("unshare", "ip", "mount", "curl", "hostname")
        if shutil.which(tool) is None
    ]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (util-linux, iproute2, curl)")
    steps = tour_steps(README.read_text())
    words = [command_words(step.command) for step in steps]
    assert sum(w.startswith("elasticd --standalone") and w.endswith("&") for w in words) == 1, words

    # The venv's python3, which every job of the tour runs: importing torch prints no warning.
    probe = subprocess.run(
        [str(VENV / "bin" / "python3"), "-c", "import torch"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0 and NUMPY_WARNING not in probe.stderr, probe.stderr

    node = f"tour{os.getpid()}"
    env = {"PATH": SYSTEM_PATH, "HOME": str(tour_dir), "LANG": "C.UTF-8", "TERM": "dumb"}
    started = time.monotonic()
    shell = Shell(namespace_argv(tour_dir, node), env, ROOT)
    ids: dict[str, str] = {}  # a job id the README shows -> the one its submit printed
    outputs: dict[str, str] = {}  # the command (without its comment) -> its stdout
    daemon = None
    try:
        try:
            code, out, _ = shell.run("hostname; echo ${VIRTUAL_ENV:-unset}", timeout=30)
        except AssertionError:  # the set-up failed: the shell ended
            code, out = -1, ""
        if code != 0 or out.split() != [node, "unset"]:
            pytest.skip(f"cannot make private mount/network/UTS namespaces here:\n{shell.text()}")

        for step, command in zip(steps, words):
            line = step.command
            for shown, real in ids.items():  # the one substitution: see the module docstring
                line = re.sub(rf"\b{re.escape(shown)}\b", real, line)
            code, out, _ = shell.run(line)
            assert code == 0, f"`{line}` exited {code}\n{shell.text()}"
            if command.endswith("&"):  # the daemon: wait until its socket answers
                daemon = int(shell.run("echo $!", timeout=10)[1])
                code, out, _ = shell.run(
                    "for _ in $(seq 600); do elasticctl version >/dev/null 2>&1 && break; "
                    f"kill -0 {daemon} 2>/dev/null || break; sleep 0.1; done; elasticctl version",
                    timeout=90,
                )
                assert code == 0 and f"on node {node}" in out, (
                    f"elasticd never answered\n{shell.text()}"
                )
            for shown_id in SUBMITTED.findall("\n".join(step.shown)):
                real = SUBMITTED.search(out)
                assert real, f"`{line}` printed no job id\n{shell.text()}"
                ids[shown_id] = real.group(1)
            assert_shown(step, out, ids, shell.text())
            outputs[command] = out

        # What the README says besides its sample output.
        assert daemon is not None
        waited = next(c for c in words if c.startswith("elasticctl submit") and "--wait" in c)
        job = SUBMITTED.search(outputs[waited]).group(1)
        assert re.search(rf"^{job} +SUCCEEDED\b", outputs[waited], re.M), shell.text()
        assert re.search(rf"^{job} .* SUCCEEDED ", outputs["elasticctl list"], re.M), shell.text()
        metrics = next(out for c, out in outputs.items() if c.startswith("curl "))
        assert re.search(r"^elasticd_build_info\{", metrics, re.M), shell.text()
        assert all("elasticd_" in m for m in metrics.splitlines()), metrics

        # SIGTERM: the daemon exits 0 and nothing the tour started is left.
        code, out, _ = shell.run(f"kill -TERM {daemon}; wait {daemon}; echo $?", timeout=90)
        assert out.strip() == "0", f"elasticd exited {out.strip()} on SIGTERM\n{shell.text()}"
        left = in_namespace(shell.proc.pid)
        assert not left, f"left after elasticd stopped:\n{describe(left)}\n{shell.text()}"

        # Every worker's stderr (the state dir is root's, /var/lib/elasticd): no NumPy warning.
        errs = shell.run("find /var/lib/elasticd/logs -name '*.err'", timeout=30)[1].split()
        assert len(errs) >= 3, f"not every rank's stderr is in the state dir: {errs}"
        code, noisy, _ = shell.run(f"grep -l '{NUMPY_WARNING}' {' '.join(errs)}", timeout=30)
        assert code == 1 and not noisy, f"{NUMPY_WARNING!r} in {noisy}"
    finally:
        if shell.proc.poll() is None:
            for pid in in_namespace(shell.proc.pid):  # only after a failure above
                os.kill(pid, signal.SIGKILL)
        shell.close()
        stuck = remove_cgroups(node)
        print(shell.text())  # the tour as it ran (pytest shows it with -s, or on failure)
        print(f"tour took {time.monotonic() - started:.1f} s")
    assert not stuck, f"cgroups left non-empty: {stuck}"
