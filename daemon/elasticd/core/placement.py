"""Placement (docs/concepts.md), pure: which open jobs this node offers itself to, and which jobs no
node of the cluster could ever run.

Every node walks the open jobs in submit order and offers itself to each one it fits
(constraints met, room for its workers, GPUs partitioned so that jobs on one node hold
disjoint devices).  Every node walks the same order, so two jobs cannot each hold half of
the nodes forever.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from elasticd.core.model import AUTO, CPU, GPU, JobSpec, PartState
from elasticd.core.records import JobRecord, Part

_DONE_HERE = frozenset({PartState.SUCCEEDED, PartState.FAILED, PartState.STOPPED})


@dataclass(frozen=True)
class Resources:
    slots: int
    gpus: tuple[str, ...] = ()
    cpus: int = 0  # the node's CPU count (what ``cpu`` and ``auto`` mean); 0: unknown


@dataclass(frozen=True)
class Offer:
    job_id: str
    nproc: int
    gpus: tuple[str, ...]  # the workers' and then the spares'
    spares: int = 0  # in place: warm workers kept beside the placed ones

    @property
    def slots(self) -> int:
        return self.nproc + self.spares


def with_spares(spec: JobSpec, offer: Offer, free: Resources, has_gpus: bool) -> Offer:
    """An in-place job's spares (``--spares``) take what is free beyond its workers, up to
    the number asked for; on a node with GPUs each spare needs a GPU of its own."""
    room = free.slots - offer.nproc
    if has_gpus:
        room = min(room, len(free.gpus) - len(offer.gpus))
    spares = max(0, min(spec.spares, room))
    if not spares:
        return offer
    spare_gpus = tuple(g for g in free.gpus if g not in offer.gpus)[:spares] if has_gpus else ()
    return replace(offer, gpus=offer.gpus + spare_gpus, spares=spares)


def fit(spec: JobSpec, free: Resources, has_gpus: bool) -> Offer | None:
    """The share of this node a job would take, or None if it does not fit now.  ``auto``
    is ``gpu`` on a node with GPUs, else ``cpu``; ``cpu`` workers take no GPU."""
    if spec.nproc_per_node == GPU or (spec.nproc_per_node == AUTO and has_gpus):
        if not free.gpus or len(free.gpus) > free.slots:
            return None
        return Offer(spec.id, len(free.gpus), free.gpus)
    if spec.nproc_per_node in (CPU, AUTO):
        if not 0 < free.cpus <= free.slots:
            return None
        return Offer(spec.id, free.cpus, ())
    nproc = int(spec.nproc_per_node)
    if nproc > free.slots or (has_gpus and nproc > len(free.gpus)):
        return None
    return Offer(spec.id, nproc, free.gpus[:nproc] if has_gpus else ())


def eligible(spec: JobSpec, node: str) -> bool:
    return node not in spec.exclude and (not spec.nodes or node in spec.nodes)


def refusal(spec: JobSpec, *, allow_root: bool, local_user: str | None) -> str | None:
    """Why this node's own rules forbid running ``spec`` here (None: they allow it).  Every
    node judges for itself before it starts workers, whichever node took the submit.
    ``local_user``: the name of the job's uid on this node (None: no such user)."""
    if spec.uid == 0:
        return (
            None
            if allow_root
            else "jobs submitted by root do not run here (jobs.allow_root = false)"
        )
    if local_user is None:
        return f"user {spec.user} (uid {spec.uid}) does not exist here"
    if local_user != spec.user and spec.user != str(spec.uid):
        return f"uid {spec.uid} is {local_user} here, not {spec.user}"
    return None


def beyond_standalone(spec: JobSpec) -> str | None:
    """Why a standalone daemon (a cluster of one node) could never start ``spec`` (its
    min, rounded up to a multiple of its --nnodes-step, is its least node count)."""
    least = -(-spec.min_nodes // spec.nnodes_step) * spec.nnodes_step
    if least <= 1:
        return None
    steps = f" (--nnodes-step {spec.nnodes_step})" if least != spec.min_nodes else ""
    return (
        f"the daemon is standalone (a one-node cluster), so a job needing {least} "
        f"nodes{steps} can never start; use --nnodes 1 or run a cluster"
    )


_SLOTS_HINT = (
    "a node's slots default to its CPU count; `elasticd --slots N` or node.slots "
    "in the config raises them"
)


def never_fits(spec: JobSpec, nodes: Iterable[dict[str, Any]]) -> str | None:
    """Why no node of the cluster could ever run a share of ``spec``, even idle; None if
    one could.  (Too few such nodes is for the join timeout: nodes may still come.)"""
    nodes = list(nodes)
    if not nodes:
        return None  # nothing seen yet: no grounds to refuse
    unknown = sorted(set(spec.nodes) - {n["name"] for n in nodes})
    if unknown:
        return f"no node named {', '.join(unknown)}; the job could never start"
    candidates = [n for n in nodes if eligible(spec, n["name"])]
    if not candidates:
        return "every node is excluded; the job could never start"
    if any(_fits_whole(spec, n) for n in candidates):
        return None
    sizes = ", ".join(_size(n) for n in candidates[:5])
    problem = f"no node can run {_wanted(spec)} on its own: {sizes}; the job could never start"
    short_of_slots = any(_fits_whole(spec, n, slots=1 << 30) for n in candidates)
    return f"{problem} ({_SLOTS_HINT})" if short_of_slots else problem


def _whole(node: dict[str, Any]) -> Resources:
    """A node as if idle, from its entry in the node list."""
    return Resources(
        node["slots_total"],
        tuple(str(i) for i in range(node["gpus_total"])),
        node.get("cpus_total", 0),
    )


def _fits_whole(spec: JobSpec, node: dict[str, Any], *, slots: int | None = None) -> bool:
    whole = _whole(node)
    if slots is not None:
        whole = replace(whole, slots=slots)
    return fit(spec, whole, has_gpus=bool(whole.gpus)) is not None


_WANTED = {
    GPU: "one worker per GPU",
    CPU: "one worker per CPU",
    AUTO: "one worker per GPU (per CPU on a node without GPUs)",
}


def _wanted(spec: JobSpec) -> str:
    return _WANTED.get(str(spec.nproc_per_node), f"{spec.nproc_per_node} workers")


def _size(node: dict[str, Any]) -> str:
    cpus = f", {node['cpus_total']} CPUs" if node.get("cpus_total") else ""
    return f"{node['name']} has {node['slots_total']} slots{cpus} and {node['gpus_total']} GPUs"


def choose_offers(
    jobs: Iterable[JobRecord],
    node: str,
    free: Resources,
    *,
    has_gpus: bool,
    busy: set[str],
    draining: bool = False,
    lost: Mapping[tuple[str, str], Part] | None = None,
) -> list[Offer]:
    """Offers this node makes, oldest job first: open jobs it fits and is not already in.
    ``lost``: (job, node) -> what a node judged lost last said of a job: that part does not
    count as a member of the job (its node will never say it ended)."""
    lost = lost or {}
    if draining:
        return []
    offers = []
    for record in sorted(jobs, key=lambda r: r.seq):
        if (
            record.outcome is not None
            or record.held
            or record.id in busy
            or not eligible(record.spec, node)
        ):
            continue
        if node in record.parts and record.parts[node].state in _DONE_HERE:
            continue  # this node's share ended; the job's end is on its way
        members = [
            part
            for name, part in record.parts.items()
            if part.state.active and lost.get((record.id, name)) != part
        ]
        if len(members) >= record.spec.max_nodes:
            continue
        offer = fit(record.spec, free, has_gpus)
        if offer is None:
            continue
        offer = with_spares(record.spec, offer, free, has_gpus) if record.spec.spares else offer
        offers.append(offer)
        free = replace(
            free,
            slots=free.slots - offer.slots,
            gpus=tuple(g for g in free.gpus if g not in offer.gpus),
        )
    return offers
