"""torchrun's command line (torch 2.13) under elasticd: every flag in both spellings, read
from ``PET_<DEST>`` exactly as torchrun reads it, and each one honoured or refused with the
reason it does not apply here.  Pure: the parser's options and the decisions; the CLI does
the I/O.

What each flag becomes (``TREATMENT``, shown by ``elasticrun --help`` and in docs/elasticrun.md):

- honoured: it changes the job (the submit request) or how the output is shown;
- launcher topology (``--rdzv-*``, ``--standalone``, ``--master-addr``, ``--node-rank``,
  ``--local-addr``): it tells one torchrun per node how to find the others.  Where no
  elasticd runs, elasticrun does what torchrun does with them: each node's elasticrun
  starts a private daemon and they meet there (topology.py reads them).  Submitted to a
  daemon, elasticd's daemons already form the cluster and one submit starts the job on every
  node, so these say nothing on a one-node job and are accepted; on a multi-node job they
  would mean "run this command on every node", which would start one job per node: refused;
- accepted, no effect: what torchrun needs for its own machinery and elasticd does
  another way (the reason is in the table);
- refused: a feature elasticd does not have; the message names what to use instead.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from elasticd.wire import numbers

# torchrun's -r/--redirects and -t/--tee streams, as its ``Std`` flags
NONE, OUT, ERR, ALL = 0, 1, 2, 3
_STD_VALUE = re.compile(r"^[0-3]$")
_STD_MAP = re.compile(r"^[0-9]+:[0-3](,[0-9]+:[0-3])*$")

HANDLED_SIGNALS = frozenset({"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"})
NNODES_DEFAULT = "1:1"
RDZV_CONF_MAPPED = {"join_timeout": "join_timeout", "last_call_timeout": "last_call_timeout"}
# keys that tell elasticrun's private daemons where and how to meet (topology.py): the job's
# key file, whether this node hosts the store, and torchrun's etcd backend's TLS settings
RDZV_CONF_PRIVATE = frozenset(
    {"key_file", "is_host", "local_addr", "protocol", "cacert", "cert", "key"}
)
# keys of torchrun's c10d rendezvous that tune its own store connection and heartbeats
RDZV_CONF_TORCHRUN_ONLY = frozenset(
    {
        "timeout",
        "read_timeout",
        "close_timeout",
        "use_libuv",
        "keep_alive_interval",
        "keep_alive_max_attempt",
    }
)
TOPOLOGY = (
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "standalone",
    "master_addr",
    "node_rank",
    "local_addr",
)

TREATMENT: dict[str, str] = {
    "nnodes": "honoured",
    "nproc_per_node": "honoured: N, gpu, cpu, auto (each node counts its own GPUs/CPUs); xpu refused",
    "rdzv_backend": "launcher topology: where no elasticd runs, how the job's private daemons "
    "meet (c10d, etcd, etcd-v2 or static); submitted to a daemon: accepted on a one-node job, "
    "refused on more",
    "rdzv_endpoint": "launcher topology: where no elasticd runs, the store's host (c10d) or an "
    "etcd member; submitted to a daemon: accepted on a one-node job, refused on more",
    "rdzv_id": "launcher topology: where no elasticd runs, names the job's private cluster; "
    "submitted to a daemon: accepted on a one-node job, refused on more",
    "rdzv_conf": "join_timeout and last_call_timeout honoured; where no elasticd runs also "
    "key_file (the job's key), is_host, local_addr and etcd's protocol, cacert, cert, key; keys "
    "for torchrun's own store accepted without effect; others refused",
    "standalone": "launcher topology: accepted on a one-node job, refused on more",
    "max_restarts": "honoured (job-wide restarts)",
    "monitor_interval": "accepted, no effect: the daemon sees a worker's exit when it happens",
    "start_method": "accepted, no effect: workers are always exec'd processes (torchrun's "
    "spawn); fork and forkserver only matter for a function entrypoint",
    "event_log_handler": "'null' accepted; others refused (events are in the job history "
    "and the Prometheus metrics)",
    "role": "honoured (ROLE_NAME)",
    "module": "honoured",
    "no_python": "honoured",
    "run_path": "honoured: the script runs as __main__ in the job's python",
    "log_dir": "honoured: the client writes a copy of every rank's output there "
    "(needs elasticrun, `elasticctl run` or --wait)",
    "redirects": "honoured (console only: every stream is also kept by the daemon)",
    "tee": "honoured: those streams shown with a [role+local rank]: prefix "
    "(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE honoured)",
    "local_ranks_filter": "honoured (console only)",
    "duplicate_stdout_filters": "refused when given: filter `elasticctl logs JOB` instead",
    "duplicate_stderr_filters": "refused when given: filter `elasticctl logs JOB` instead",
    "node_rank": "launcher topology: where no elasticd runs, node rank 0 hosts the store in "
    "the static form (ranks come from the rendezvous); submitted to a daemon: 0 accepted on a "
    "one-node job, refused otherwise",
    "master_addr": "launcher topology: where no elasticd runs, the store's host in the static "
    "form; submitted to a daemon: accepted on a one-node job, refused on more (MASTER_ADDR is "
    "group rank 0's node, every round)",
    "master_port": "honoured: a fixed MASTER_PORT for every round (default: a free port; with "
    "`--in-place`, P or P + 1 from one round to the next); in the static form where no "
    "elasticd runs, the store's port",
    "local_addr": "launcher topology: where no elasticd runs, this node's address for the "
    "others; submitted to a daemon: accepted on a one-node job, refused on more (a node's "
    "address is elasticd --node-address)",
    "logs_specs": "refused when given: a torchrun log plugin; the daemon keeps every "
    "rank's output (elasticctl logs) and --log-dir copies it",
    "numa_binding": "refused when given: wrap the command instead, e.g. --no-python numactl ...",
    "signals_to_handle": "SIGTERM, SIGINT, SIGHUP, SIGQUIT honoured (each cancels the job); "
    "others refused",
    "shutdown_timeout": "refused when given: the grace before SIGKILL is the daemon's "
    "jobs.stop_grace",
    "virtual_local_rank": "refused when given: LOCAL_RANK is the worker's slot and "
    "CUDA_VISIBLE_DEVICES lists the job's GPUs on the node",
}


class TorchrunError(ValueError):
    """A torchrun option that cannot be honoured here: one line, the reason and what to use."""


# -- the parser -----------------------------------------------------------------------------


def env_default(environ: Mapping[str, str]) -> type[argparse.Action]:
    """torchrun's ``env`` action: a value option whose default is ``PET_<DEST>`` if set."""

    class FromEnv(argparse.Action):
        def __init__(self, dest: str, default: Any = None, **kwargs: Any) -> None:
            super().__init__(
                dest=dest, default=environ.get(f"PET_{dest.upper()}", default), **kwargs
            )

        def __call__(
            self, parser: Any, namespace: Any, values: Any, option_string: Any = None
        ) -> None:
            setattr(namespace, self.dest, values)

    return FromEnv


def env_switch(environ: Mapping[str, str]) -> type[argparse.Action]:
    """torchrun's ``check_env`` action: a switch that ``PET_<DEST>=1`` turns on (0 off)."""

    class SwitchFromEnv(argparse.Action):
        def __init__(self, dest: str, **kwargs: Any) -> None:
            value = environ.get(f"PET_{dest.upper()}", "0")
            try:
                default = bool(numbers.whole(value, signed=True))
            except ValueError:
                raise TorchrunError(
                    f"PET_{dest.upper()}={value!r}: expected 0 or 1 (as torchrun reads it)"
                ) from None
            super().__init__(dest=dest, const=True, default=default, nargs=0, **kwargs)

        def __call__(
            self, parser: Any, namespace: Any, values: Any, option_string: Any = None
        ) -> None:
            setattr(namespace, self.dest, True)

    return SwitchFromEnv


class Options(Protocol):
    """Where options are added: a parser, or one of its argument groups."""

    def add_argument(self, *names: str, **kwargs: Any) -> object: ...


def add_options(
    parser: Options,
    environ: Mapping[str, str],
    types: Mapping[str, Callable[[str], Any]],
) -> None:
    """Every torchrun option, as torchrun declares it (names, defaults, PET_*), with its
    treatment here as the help text.  ``types``: the CLI's checks for some of them, by dest
    (a string default, as from PET_*, goes through them too)."""
    value, switch = env_default(environ), env_switch(environ)

    def option(*names: str, action: Any = value, **kwargs: Any) -> None:
        dest = max(names, key=len).lstrip("-").replace("-", "_")
        if dest in types:
            kwargs["type"] = types[dest]
        parser.add_argument(
            *names, dest=dest, action=action, help=TREATMENT[dest].replace("%", "%%"), **kwargs
        )

    option("--nnodes", default=NNODES_DEFAULT, metavar="N|MIN:MAX")
    option("--nproc-per-node", "--nproc_per_node", default="1", metavar="N|gpu|cpu|auto")
    for name in ("rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf"):
        option(f"--{name}", f"--{name.replace('-', '_')}", default=None, metavar="VALUE")
    option("--standalone", action=switch)
    option("--max-restarts", "--max_restarts", type=_whole, default=None, metavar="N")
    option("--monitor-interval", "--monitor_interval", type=_decimal, default=0.1, metavar="S")
    option(
        "--start-method", "--start_method", default="spawn", choices=["spawn", "fork", "forkserver"]
    )
    option("--event-log-handler", "--event_log_handler", default="null", metavar="NAME")
    option("--role", default="default", metavar="NAME")
    option("-m", "--module", action=switch)
    option("--no-python", "--no_python", action=switch)
    option("--run-path", "--run_path", action=switch)
    option("--log-dir", "--log_dir", default=None, metavar="DIR")
    option("-r", "--redirects", default="0", metavar="STD")
    option("-t", "--tee", default="0", metavar="STD")
    option("--local-ranks-filter", "--local_ranks_filter", default="", metavar="R,R")
    option("--duplicate-stdout-filters", "--duplicate_stdout_filters", default="", metavar="F,F")
    option("--duplicate-stderr-filters", "--duplicate_stderr_filters", default="", metavar="F,F")
    option("--node-rank", "--node_rank", type=_whole, default=0, metavar="N")
    option("--master-addr", "--master_addr", default=None, metavar="HOST")
    option("--master-port", "--master_port", type=_port, default=None, metavar="PORT")
    option("--local-addr", "--local_addr", default=None, metavar="HOST")
    option("--logs-specs", "--logs_specs", action="store", default=None, metavar="NAME")
    option(
        "--numa-binding",
        "--numa_binding",
        action="store",
        default=None,
        choices=["node", "socket", "exclusive", "core-complex"],
    )
    option(
        "--signals-to-handle",
        "--signals_to_handle",
        default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        metavar="SIG,SIG",
    )
    option("--shutdown-timeout", "--shutdown_timeout", type=_whole, default=None, metavar="S")
    option("--virtual-local-rank", "--virtual_local_rank", action=switch)


def _whole(text: str) -> int:
    try:
        return numbers.whole(text, signed=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _decimal(text: str) -> float:
    try:
        return numbers.decimal(text, signed=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port(text: str) -> int:
    port = _whole(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, got {text!r}")
    return port


# -- the decisions --------------------------------------------------------------------------


@dataclass(frozen=True)
class Output:
    """How a following client shows the workers' output, per local rank and stream: not at
    all (redirected or filtered out), prefixed (teed), or as it is (torchrun's inherited
    console); and where it copies it (``log_dir``)."""

    redirects: int | dict[int, int] = NONE
    tee: int | dict[int, int] = NONE
    ranks_shown: frozenset[int] | None = None
    log_dir: str | None = None
    prefix_template: str | None = None
    role: str = "default"

    def shown(self, stream: str, local_rank: int) -> str | None:
        """'plain', 'prefixed' or None (not on the console) for one line's source."""
        bit = OUT if stream == "out" else ERR
        if self.ranks_shown is not None and local_rank not in self.ranks_shown:
            return None
        if _std_of(self.tee, local_rank) & bit:
            return "prefixed"
        if _std_of(self.redirects, local_rank) & bit:
            return None
        return "plain"

    def prefix(self, rank: int, local_rank: int) -> str:
        """torchrun's tee prefix: '[default0]:', or its template with ${role_name}, ${rank}
        and ${local_rank}."""
        if self.prefix_template is None:
            return f"[{self.role}{local_rank}]:"
        from string import Template

        return Template(self.prefix_template).safe_substitute(
            role_name=self.role, rank=rank, local_rank=local_rank
        )

    @property
    def needs_follower(self) -> bool:
        """Whether this output asks for more than the daemon's own logs."""
        return bool(self.redirects or self.tee or self.ranks_shown is not None or self.log_dir)


def _std_of(setting: int | dict[int, int], local_rank: int) -> int:
    return setting.get(local_rank, NONE) if isinstance(setting, dict) else setting


def parse_std(text: str, flag: str) -> int | dict[int, int]:
    """'3' -> 3; '0:1,1:2' -> {0: 1, 1: 2} (torchrun's Std.from_str)."""
    if _STD_VALUE.fullmatch(text):
        return numbers.whole(text)
    if _STD_MAP.fullmatch(text):
        return {
            numbers.whole(rank): numbers.whole(std)
            for rank, std in (pair.split(":") for pair in text.split(","))
        }
    raise TorchrunError(
        f"{flag} {text!r}: expected 0-3 (none, stdout, stderr, both) or "
        "LOCAL_RANK:STD pairs like 0:1,1:2"
    )


def ranks_filter(text: str) -> frozenset[int] | None:
    if not text:
        return None
    try:
        ranks = frozenset(numbers.whole(item) for item in text.split(","))
    except ValueError:
        raise TorchrunError(
            f"--local-ranks-filter {text!r}: expected local ranks like 0,1,2"
        ) from None
    return ranks


def rdzv_pairs(text: str | None) -> dict[str, str]:
    """``--rdzv-conf k=v,...`` as a dict; a pair that is not KEY=VALUE, or a key that means
    nothing here, is refused."""
    pairs: dict[str, str] = {}
    for pair in filter(None, (text or "").split(",")):
        key, equals, value = pair.partition("=")
        key = key.strip()
        if not equals:
            raise TorchrunError(f"--rdzv-conf {pair!r}: expected KEY=VALUE pairs")
        if key not in RDZV_CONF_MAPPED.keys() | RDZV_CONF_TORCHRUN_ONLY | RDZV_CONF_PRIVATE:
            raise TorchrunError(
                f"--rdzv-conf key {key!r} means nothing under elasticd "
                f"(it maps {', '.join(RDZV_CONF_MAPPED)}; without a daemon also "
                f"{', '.join(sorted(RDZV_CONF_PRIVATE))}; daemon settings are in its config)"
            )
        pairs[key] = value.strip()
    return pairs


def rdzv_conf(text: str | None) -> dict[str, float]:
    """The keys of ``--rdzv-conf k=v,...`` that are submit arguments, as those."""
    mapped: dict[str, float] = {}
    for key, value in rdzv_pairs(text).items():
        if key in RDZV_CONF_MAPPED:
            try:
                mapped[RDZV_CONF_MAPPED[key]] = _number(numbers.decimal(value.strip()))
            except ValueError:
                raise TorchrunError(f"--rdzv-conf {key}={value!r}: expected seconds") from None
    return mapped


def _number(value: float) -> int | float:
    return int(value) if value.is_integer() else value


def refusals(args: argparse.Namespace, one_node: bool, private: bool = False) -> list[str]:
    """Why each given option cannot be honoured here (empty: all can).  ``private``: the
    line runs on daemons of its own, one per node, which its launcher topology forms."""
    found = []
    if not one_node and private and args.standalone:
        found.append("--standalone: a one-node job; leave it out to run on several nodes")
    if not one_node and not private:
        given = [name for name in TOPOLOGY if _given_topology(args, name)]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            found.append(
                f"{flags}: elasticd's daemons are the rendezvous and one submit starts "
                "the job on every node; submit once, on any node, without them "
                "(running this on every node would start one job per node), or run the line "
                "on every node with `elasticrun --private`, on daemons of the job's own"
            )
    if one_node and args.node_rank not in (0, None):
        found.append(
            f"--node-rank {args.node_rank}: a one-node job has node rank 0; elasticd "
            "gives every node its rank"
        )
    if args.event_log_handler not in ("null", None):
        found.append(
            f"--event-log-handler {args.event_log_handler}: torchrun's event handlers "
            "do not run here; events are in the job history and the Prometheus metrics"
        )
    for dest, flag, why in (
        (
            "duplicate_stdout_filters",
            "--duplicate-stdout-filters",
            "filter `elasticctl logs JOB` instead",
        ),
        (
            "duplicate_stderr_filters",
            "--duplicate-stderr-filters",
            "filter `elasticctl logs JOB` instead",
        ),
        (
            "logs_specs",
            "--logs-specs",
            "the daemon keeps every rank's output (elasticctl logs); --log-dir copies it",
        ),
        (
            "numa_binding",
            "--numa-binding",
            "elasticd does not bind workers to NUMA nodes; "
            "wrap the command, e.g. --no-python numactl ...",
        ),
        (
            "shutdown_timeout",
            "--shutdown-timeout",
            "the grace before SIGKILL is the daemon's jobs.stop_grace",
        ),
        (
            "virtual_local_rank",
            "--virtual-local-rank",
            "not supported: LOCAL_RANK is the "
            "worker's slot and CUDA_VISIBLE_DEVICES "
            "lists the job's GPUs on the node",
        ),
    ):
        if getattr(args, dest):
            found.append(f"{flag}: {why}")
    unknown = sorted(set(_signals(args.signals_to_handle)) - HANDLED_SIGNALS)
    if unknown:
        found.append(
            f"--signals-to-handle {','.join(unknown)}: the workers may run on other "
            "nodes; only SIGTERM, SIGINT, SIGHUP and SIGQUIT are handled (each "
            "cancels the job)"
        )
    return found


def _given_topology(args: argparse.Namespace, name: str) -> bool:
    value = getattr(args, name)
    return bool(value) if name != "node_rank" else value not in (0, None)


def _signals(text: str) -> list[str]:
    return [name.strip().upper() for name in (text or "").split(",") if name.strip()]


def job_options(args: argparse.Namespace, one_node: bool, private: bool = False) -> dict[str, Any]:
    """The submit arguments the torchrun options give (raises TorchrunError with every
    refusal, one per line)."""
    refused = refusals(args, one_node, private)
    if refused:
        raise TorchrunError("\n".join(refused))
    options: dict[str, Any] = dict(rdzv_conf(args.rdzv_conf))
    if args.role != "default":
        options["role"] = args.role
    if args.master_port is not None:
        options["master_port"] = args.master_port
    return options


def kind(args: argparse.Namespace) -> str:
    """torchrun's order: --run-path over -m over --no-python."""
    if args.run_path:
        return "script"
    if args.module:
        return "module"
    return "exec" if args.no_python else "script"


def output(args: argparse.Namespace, environ: Mapping[str, str]) -> Output:
    return Output(
        redirects=parse_std(args.redirects, "--redirects"),
        tee=parse_std(args.tee, "--tee"),
        ranks_shown=ranks_filter(args.local_ranks_filter),
        log_dir=args.log_dir,
        role=args.role,
        prefix_template=environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
    )


def handled_signals(text: str) -> list[str]:
    """The signals of ``--signals-to-handle`` that cancel a followed job."""
    return [name for name in _signals(text) if name in HANDLED_SIGNALS]
