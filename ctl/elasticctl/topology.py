"""Where a torchrun line that runs once per node meets the other nodes, as elasticrun reads
it for the job's private daemons (docs/elasticrun.md, "Where no elasticd runs").  Pure: the
parsed line and the environment come in, a ``Topology`` (or a TorchrunError) goes out.

The line says it in one of torchrun's forms:

- c10d: ``--rdzv-backend c10d --rdzv-endpoint HOST[:PORT]`` (port 29400): the node whose
  address HOST is hosts the store (``--rdzv-conf is_host=0|1`` says so instead), the others
  join it;
- etcd: ``--rdzv-backend etcd|etcd-v2 --rdzv-endpoint HOST[:PORT]`` (port 2379): an etcd
  cluster that no node hosts (``protocol=https``, ``cacert``, ``cert``, ``key`` in
  ``--rdzv-conf`` as torchrun's etcd backend takes them);
- static (torchrun's default backend): ``--master-addr HOST --master-port PORT`` (port 29500)
  with ``--node-rank R``: node rank 0 hosts the store at HOST:PORT.

Inside a Slurm step (``srun elasticrun ...``) what the line leaves out is Slurm's: the step's
node count for ``--nnodes``, its job id for ``--rdzv-id``, its first node (port 29400) for the
endpoint, and the key the allocation's tasks make for themselves (``slurm_key``).
"""

from __future__ import annotations

import argparse
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from elasticctl.torchrun import NNODES_DEFAULT, TorchrunError, rdzv_pairs
from elasticd.wire import protocol

C10D_PORT = 29400  # torchrun's c10d default
ETCD_PORT = 2379
STATIC_PORT = 29500  # torchrun's --master-port default
C10D, ETCD, STATIC = "c10d", "etcd", "static"
BACKENDS = {"c10d": C10D, "etcd": ETCD, "etcd-v2": ETCD, "static": STATIC}
TRUE, FALSE = ("1", "true", "yes", "y", "on"), ("0", "false", "no", "n", "off")
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,48}$")


@dataclass(frozen=True)
class Topology:
    """How this node's private daemon finds the job's other nodes."""

    nnodes: str  # the job's N or MIN:MAX
    backend: str = ""  # C10D, ETCD or STATIC; "": a one-node job (no store port at all)
    host: str = ""  # the endpoint: the store's host (c10d, static) or an etcd member
    port: int = 0
    run_id: str = "none"
    hosts_store: bool | None = None  # None: when HOST is one of this node's addresses
    local_addr: str = ""  # this node's address for the others (--local-addr)
    key_file: str = ""  # --rdzv-conf key_file: the job's key, a 0600 file on every node
    slurm_job: str = ""  # inside a Slurm step: its job id (the allocation makes its key)
    slurm_first: bool = False  # ... and this is its task 0, which makes the key
    etcd_tls: Mapping[str, str] = field(default_factory=dict)  # store.{ca,cert,key}_file
    from_slurm: tuple[str, ...] = ()  # what Slurm said that the line did not, as options

    @property
    def one_node(self) -> bool:
        return self.backend == ""

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def cluster(self) -> str:
        """The private cluster's name: every store key of the job is under it."""
        if _SAFE_ID.match(self.run_id):
            return f"elasticrun-{self.run_id}"
        digest = hashlib.sha256(self.run_id.encode("utf-8", "surrogateescape")).hexdigest()
        return f"elasticrun-{digest[:16]}"


def slurm_step(environ: Mapping[str, str]) -> bool:
    """Inside a step that srun started (the batch script itself is not one: it runs once)."""
    return bool(environ.get("SLURM_JOB_ID") and environ.get("SLURM_STEP_ID") is not None)


def resolve(args: argparse.Namespace, environ: Mapping[str, str]) -> Topology:
    """The line's topology, with Slurm's words where the line has none (TorchrunError for a
    line that cannot say where the store is)."""
    conf = rdzv_pairs(args.rdzv_conf)
    in_slurm = slurm_step(environ)
    told: list[str] = []
    nnodes = args.nnodes
    if in_slurm and nnodes == NNODES_DEFAULT:
        count = environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES") or "1"
        if count.isdigit() and int(count) > 1:
            nnodes = count
            told.append(f"--nnodes {count}")
    if protocol.parse_nnodes(nnodes)[1] == 1:
        return Topology(nnodes=nnodes)
    run_id = args.rdzv_id
    if run_id is None:
        run_id = environ.get("SLURM_JOB_ID") if in_slurm else None
        if run_id:
            told.append(f"--rdzv-id {run_id}")
    backend = _backend(args)
    host, port = _endpoint(args, backend, environ if in_slurm else {}, told)
    hosts_store: bool | None = None
    if "is_host" in conf:
        hosts_store = _flag(conf["is_host"], "is_host")
    elif backend == STATIC:
        hosts_store = args.node_rank == 0
    return Topology(
        nnodes=nnodes,
        backend=backend,
        host=host,
        port=port,
        run_id=run_id or "none",
        hosts_store=None if backend == ETCD else hosts_store,
        local_addr=args.local_addr or conf.get("local_addr", ""),
        key_file=conf.get("key_file", ""),
        slurm_job=environ.get("SLURM_JOB_ID", "") if in_slurm else "",
        slurm_first=in_slurm and environ.get("SLURM_PROCID", "0") == "0",
        etcd_tls=_etcd_tls(conf) if backend == ETCD else {},
        from_slurm=tuple(told),
    )


def _backend(args: argparse.Namespace) -> str:
    """torchrun's default backend is static; a line that names neither a backend nor
    --master-addr/--node-rank means c10d (with static every node would be rank 0)."""
    name = args.rdzv_backend
    if name is None:
        return STATIC if args.master_addr is not None or args.node_rank else C10D
    if name not in BACKENDS:
        raise TorchrunError(
            f"--rdzv-backend {name}: elasticrun's private daemons meet in c10d (a store that "
            "one node hosts), etcd (etcd-v2 is the same: etcd's v3 API) or static"
        )
    return BACKENDS[name]


def _endpoint(
    args: argparse.Namespace, backend: str, slurm: Mapping[str, str], told: list[str]
) -> tuple[str, int]:
    text = args.rdzv_endpoint
    default = {C10D: C10D_PORT, ETCD: ETCD_PORT, STATIC: STATIC_PORT}[backend]
    if backend == STATIC and not text:
        port = args.master_port if args.master_port is not None else STATIC_PORT
        return args.master_addr or "127.0.0.1", port
    if not text:
        nodelist = (
            slurm.get("SLURM_STEP_NODELIST")
            or slurm.get("SLURM_JOB_NODELIST")
            or slurm.get("SLURM_NODELIST")
        )
        if backend == ETCD or not nodelist:
            raise TorchrunError(
                "--rdzv-endpoint HOST[:PORT] is needed: the "
                + ("etcd member to use" if backend == ETCD else "node that hosts the job's store")
                + " (inside a Slurm step it defaults to the step's first node)"
            )
        host = first_host(nodelist)
        told.append(f"--rdzv-endpoint {host}:{C10D_PORT}")
        return host, C10D_PORT
    return split(text, default)


def split(text: str, default_port: int) -> tuple[str, int]:
    """'host', 'host:port', '[v6]:port' -> (host, port)."""
    host, port = text, ""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not host or (port and not port.isdigit()) or int(port or default_port) > 65535:
        raise TorchrunError(f"--rdzv-endpoint {text!r}: expected HOST[:PORT]")
    return host, int(port) if port else default_port


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: 'gpu[07-09,12],cpu3' -> 'gpu07',
    'r[1-2]-n[4-5]' -> 'r1-n4'."""
    host, depth, inside = [], 0, ""
    for char in nodelist.strip():
        if depth:
            if char == "]":
                depth = 0
                host.append(re.split(r"[,-]", inside, maxsplit=1)[0])
                inside = ""
            else:
                inside += char
        elif char == "[":
            depth = 1
        elif char == ",":
            break
        else:
            host.append(char)
    first = "".join(host)
    if depth or not first:
        raise TorchrunError(f"SLURM_JOB_NODELIST {nodelist!r}: not a Slurm host list")
    return first


def _flag(value: str, key: str) -> bool:
    if value.lower() in TRUE:
        return True
    if value.lower() in FALSE:
        return False
    raise TorchrunError(f"--rdzv-conf {key}={value!r}: expected true or false")


def _etcd_tls(conf: Mapping[str, str]) -> dict[str, str]:
    """torchrun's etcd keys as the etcd store's settings."""
    if conf.get("protocol", "http") not in ("http", "https"):
        raise TorchrunError(f"--rdzv-conf protocol={conf['protocol']!r}: expected http or https")
    tls = {
        ours: conf[theirs]
        for theirs, ours in (("cacert", "ca_file"), ("cert", "cert_file"), ("key", "key_file"))
        if conf.get(theirs)
    }
    if conf.get("protocol") == "https" and "ca_file" not in tls:
        raise TorchrunError("--rdzv-conf protocol=https needs cacert=FILE (the members' CA)")
    return tls
