"""Placement (DESIGN §5), pure: which open jobs this node offers itself to, and which jobs no
node of the cluster could ever run.

Every node walks the open jobs in submit order and offers itself to each one it fits
(constraints met, room for its workers, GPUs partitioned so that jobs on one node hold
disjoint devices).  Every node walks the same order, so two jobs cannot each hold half of
the nodes forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from .records import JobRecord
from .model import GPU, JobSpec, PartState

_DONE_HERE = frozenset({PartState.SUCCEEDED, PartState.FAILED, PartState.STOPPED})


@dataclass(frozen=True)
class Resources:
    slots: int
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class Offer:
    job_id: str
    nproc: int
    gpus: tuple[str, ...]


def fit(spec: JobSpec, free: Resources, has_gpus: bool) -> Offer | None:
    """The share of this node a job would take, or None if it does not fit now."""
    if spec.nproc_per_node == GPU:
        if not free.gpus or len(free.gpus) > free.slots:
            return None
        return Offer(spec.id, len(free.gpus), free.gpus)
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
        return None if allow_root else "jobs submitted by root do not run here (jobs.allow_root = false)"
    if local_user is None:
        return f"user {spec.user} (uid {spec.uid}) does not exist here"
    if local_user != spec.user and spec.user != str(spec.uid):
        return f"uid {spec.uid} is {local_user} here, not {spec.user}"
    return None


def never_fits(spec: JobSpec, nodes: Iterable[dict[str, Any]]) -> str | None:
    """Why no node of the cluster could ever run a share of ``spec``, even idle; None if
    one could.  (Too few such nodes is for the join timeout: nodes may still come.)"""
    nodes = list(nodes)
    if not nodes:
        return None  # nothing seen yet: no grounds to refuse
    unknown = sorted(set(spec.nodes) - {n["name"] for n in nodes})
    if unknown:
        return f"no node named {', '.join(unknown)}"
    candidates = [n for n in nodes if eligible(spec, n["name"])]
    if not candidates:
        return "every node is excluded"
    for node in candidates:
        whole = Resources(node["slots_total"], tuple(str(i) for i in range(node["gpus_total"])))
        if fit(spec, whole, has_gpus=bool(whole.gpus)) is not None:
            return None
    wanted = "one worker per GPU" if spec.nproc_per_node == GPU else f"{spec.nproc_per_node} workers"
    sizes = ", ".join(f"{n['name']} has {n['slots_total']} slots and {n['gpus_total']} GPUs"
                      for n in candidates[:5])
    return f"no node can run {wanted} on its own: {sizes}"


def place(jobs: Iterable[JobRecord], node: str, free: Resources, *, has_gpus: bool,
          busy: set[str], draining: bool = False) -> list[Offer]:
    """Offers this node makes, oldest job first: open jobs it fits and is not already in."""
    if draining:
        return []
    offers = []
    for record in sorted(jobs, key=lambda r: r.seq):
        if record.outcome is not None or record.held or record.id in busy or not eligible(record.spec, node):
            continue
        if node in record.parts and record.parts[node].state in _DONE_HERE:
            continue  # this node's share ended; the job's end is on its way
        members = [p for p in record.parts.values() if p.state.active]
        if len(members) >= record.spec.max_nodes:
            continue
        offer = fit(record.spec, free, has_gpus)
        if offer is None:
            continue
        offers.append(offer)
        free = Resources(free.slots - offer.nproc, tuple(g for g in free.gpus if g not in offer.gpus))
    return offers
