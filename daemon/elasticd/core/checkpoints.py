"""The checkpoint tier's rules, pure: which checkpoints of a job are complete, which node
keeps the copy of a node's part, what a node must fetch before its workers read one, what
it may delete, and what reaches disk.

A job's workers save checkpoints into ``ELASTICD_CHECKPOINT_DIR``, a directory the daemon
keeps in memory on each node; each checkpoint is one entry there: a directory written with
``torch.distributed.checkpoint`` (DCP: ``step_40/``), or a file a rank wrote itself
(``torch.save``: ``rank1.pt``).  Each node describes its share of each
checkpoint in a *manifest* that travels in its signed part record (core/records.py
``Part.checkpoints``): the files its ranks wrote, their sizes and SHA-256, whether it holds
DCP's ``.metadata`` (rank 0's node: DCP writes it last, once every rank's files are written),
which node keeps a copy, and whether the files reached the job's ``--checkpoint-dir``.

A DCP checkpoint is complete (two-phase) once the nodes' manifests cover every rank of the
world that saved it, one of them holds its ``.metadata``, and every node's files were copied
to another node (a job on one node has none to copy to).  The newest complete one is the one
restored; a newer one that is not complete (a save torn by a failure) never is, and it is
deleted before the workers read.  A file a rank wrote itself is its own checkpoint, complete
once closed and copied: there is no telling which files make one save, so the newest version
of each is restored (a script that writes them whole, to a temporary name then renamed, is
never read half-written).  The daemon never reads what the files hold.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

METADATA = ".metadata"  # DCP's: written last, by the coordinator (rank 0), once all wrote
DCP, FILE = "dcp", "file"  # the two kinds of checkpoint
MAX_FILES = 4096  # files one node's manifest of one checkpoint may list
MAX_KEPT = 8  # DCP manifests one node's part carries (the newest)
MAX_KEPT_FILES = 64  # and manifests of files its ranks wrote themselves (the newest)
# What a checkpoint's and a file's names may be: no path separators, nothing hidden but
# DCP's .metadata, bounded.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def valid_name(name: str) -> bool:
    """A checkpoint's or a file's name, as the tier accepts it (no path, no traversal)."""
    return name == METADATA or (_NAME.fullmatch(name) is not None and ".." not in name)


@dataclass(frozen=True)
class FileFacts:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """One node's share of one checkpoint."""

    id: str  # the checkpoint's entry in the job's directory
    node: str
    round: int  # the round whose workers wrote it
    world: int  # the world size that saved it
    ranks: tuple[int, ...]  # the global ranks of this node's workers then
    files: Mapping[str, FileFacts] = field(default_factory=dict)
    saved: float = 0.0  # wall clock: when this node knew its files whole (in save order)
    copied_to: str = ""  # the node that keeps a copy ("" none yet)
    on_disk: bool = False  # this node's files are in --checkpoint-dir
    kind: str = "dcp"  # "dcp": a directory; "file": one file a rank wrote itself
    # False while the node still hashes its files: rank 0's node tells its metadata at once
    # (the other nodes' cue that their shares are whole), before its data files are listed
    described: bool = True

    @property
    def metadata(self) -> bool:
        return METADATA in self.files

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "node": self.node,
            "round": self.round,
            "world": self.world,
            "ranks": list(self.ranks),
            "files": {name: [f.size, f.sha256] for name, f in sorted(self.files.items())},
            "saved": self.saved,
            "copied_to": self.copied_to,
            "on_disk": self.on_disk,
            "kind": self.kind,
            "described": self.described,
        }


class BadManifest(ValueError):
    """A part's manifest that is not one (an older or broken daemon's): it is left out."""


def parse(doc: Any) -> Manifest:
    """A manifest from a part record (bounded and checked: names, counts, numbers)."""
    if not isinstance(doc, Mapping):
        raise BadManifest("not an object")
    try:
        ident, node = doc["id"], doc["node"]
        round, world, ranks = doc["round"], doc["world"], doc["ranks"]
        files, saved = doc["files"], doc.get("saved", 0.0)
        copied_to, on_disk = doc.get("copied_to", ""), doc.get("on_disk", False)
        kind, described = doc.get("kind", DCP), doc.get("described", True)
    except KeyError as exc:
        raise BadManifest(f"no {exc.args[0]}") from None
    if not (isinstance(ident, str) and valid_name(ident) and ident != METADATA):
        raise BadManifest(f"checkpoint name {ident!r}")
    if not isinstance(node, str) or not isinstance(copied_to, str) or not isinstance(on_disk, bool):
        raise BadManifest("node, copied_to or on_disk")
    if not isinstance(described, bool):
        raise BadManifest("described")
    if kind not in (DCP, FILE):
        raise BadManifest(f"kind {kind!r}")
    if not (_count(round) and _count(world) and world > 0):
        raise BadManifest("round or world")
    if not (isinstance(ranks, list) and all(_count(r) and r < world for r in ranks)):
        raise BadManifest("ranks")
    if not (isinstance(files, Mapping) and len(files) <= MAX_FILES):
        raise BadManifest("files")
    facts: dict[str, FileFacts] = {}
    for name, entry in files.items():
        if not (isinstance(name, str) and valid_name(name)):
            raise BadManifest(f"file name {name!r}")
        if not (isinstance(entry, list) and len(entry) == 2):
            raise BadManifest(f"file {name}")
        size, digest = entry
        if not (_count(size) and isinstance(digest, str) and _SHA256.fullmatch(digest)):
            raise BadManifest(f"file {name}")
        facts[name] = FileFacts(size, digest)
    if not (
        isinstance(saved, (int, float)) and not isinstance(saved, bool) and math.isfinite(saved)
    ):
        raise BadManifest("saved")
    if kind == FILE and set(facts) != {ident}:
        raise BadManifest("a file checkpoint holds its one file")
    return Manifest(
        ident,
        node,
        round,
        world,
        tuple(ranks),
        facts,
        float(saved),
        copied_to,
        on_disk,
        kind,
        described,
    )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53


def manifests(parts: Iterable[tuple[str, Iterable[Any]]]) -> list[Manifest]:
    """Every valid manifest of ``(node, its part's checkpoints)``; one claimed for another
    node than the part's is not believed."""
    found = []
    for node, docs in parts:
        for doc in docs:
            try:
                manifest = parse(doc)
            except BadManifest:
                continue
            if manifest.node == node:
                found.append(manifest)
    return found


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint as the cluster knows it: every node's manifest of it."""

    id: str
    round: int
    world: int
    shares: Mapping[str, Manifest]  # node -> its manifest
    kind: str = DCP

    @property
    def ranks(self) -> set[int]:
        return {rank for m in self.shares.values() for rank in m.ranks}

    @property
    def saved(self) -> float:
        """When the first node knew its share whole: checkpoints sort by it (in the order
        they were saved, however long each took to describe and copy)."""
        return min((m.saved for m in self.shares.values()), default=0.0)

    @property
    def size(self) -> int:
        return sum(m.size for m in self.shares.values())

    @property
    def written(self) -> bool:
        """DCP: every rank's files are there, each node's listed, and its metadata (written
        last); a file: it is."""
        if self.kind == FILE:
            return bool(self.shares)
        return (
            self.ranks == set(range(self.world))
            and any(m.metadata for m in self.shares.values())
            and all(m.described for m in self.shares.values())
        )

    @property
    def complete(self) -> bool:
        """Written, and every node's share copied to another node (one node: nowhere to)."""
        return self.written and (
            len(self.shares) == 1 or all(m.copied_to for m in self.shares.values())
        )

    @property
    def on_disk(self) -> bool:
        return self.written and all(m.on_disk for m in self.shares.values())

    def holders(self, name: str) -> list[str]:
        """The nodes that hold file ``name``: its writer, then the copy's keeper."""
        out = []
        for node, share in sorted(self.shares.items()):
            if name in share.files:
                out.append(node)
                if share.copied_to:
                    out.append(share.copied_to)
        return out

    def files(self) -> dict[str, FileFacts]:
        return {name: f for m in self.shares.values() for name, f in m.files.items()}


def checkpoints(found: Iterable[Manifest]) -> list[Checkpoint]:
    """The job's checkpoints, oldest first (by the round that saved them, then the time).
    Shares of one DCP id from different rounds are different checkpoints: the newest
    round's is kept (a name reused after a re-form); a file's newest version is kept."""
    by_id: dict[str, dict[str, Manifest]] = {}
    rounds: dict[str, int] = {}
    for manifest in found:
        if manifest.kind == FILE:
            held = by_id.get(manifest.id)
            if held and max(m.saved for m in held.values()) > manifest.saved:
                continue
            by_id[manifest.id], rounds[manifest.id] = {manifest.node: manifest}, manifest.round
            continue
        newest = rounds.get(manifest.id, -1)
        if manifest.round > newest:
            by_id[manifest.id], rounds[manifest.id] = {}, manifest.round
        if manifest.round >= newest:
            by_id[manifest.id][manifest.node] = manifest
    out = [
        Checkpoint(
            ident,
            rounds[ident],
            max(m.world for m in shares.values()),
            shares,
            next(iter(shares.values())).kind,
        )
        for ident, shares in by_id.items()
    ]
    return sorted(out, key=lambda c: (c.round, c.saved, c.id))


def latest_complete(found: Iterable[Manifest]) -> Checkpoint | None:
    """The newest complete DCP checkpoint (the one a restart reads)."""
    done = [c for c in checkpoints(found) if c.complete and c.kind == DCP]
    return done[-1] if done else None


def restored(found: Iterable[Manifest], chosen: Checkpoint | None = None) -> list[Checkpoint]:
    """What a restart puts in place: the newest complete DCP checkpoint (``chosen``, where
    the round agreed on one) and the newest complete version of every file a rank wrote
    itself."""
    found = list(found)
    latest = chosen or latest_complete(found)
    files = [c for c in checkpoints(found) if c.kind == FILE and c.complete]
    return ([latest] if latest is not None else []) + files


def buddy(node: str, members: Iterable[str], domains: Mapping[str, str]) -> str | None:
    """The node that keeps a copy of ``node``'s share: the next member after it (in the
    members' order) in another failure domain, else the next member at all; never itself.
    ``domains``: each node's failure domain (a node without one is its own)."""
    ring = list(dict.fromkeys(members))
    if node not in ring or len(ring) < 2:
        return None
    start = ring.index(node)
    after = ring[start + 1 :] + ring[:start]
    mine = domains.get(node) or node
    other = [n for n in after if (domains.get(n) or n) != mine]
    return (other or after)[0]


@dataclass(frozen=True)
class Holding:
    """The part of a job's state a node holds in memory: the parts that ranks ``ranks`` of
    ``world`` saved of checkpoint ``checkpoint``, its own workers' and the copies it keeps.
    A joining node declares it: the round's ranks go where it moves the least
    (rendezvous/locality.py)."""

    checkpoint: str
    world: int
    ranks: tuple[int, ...]
    round: int = 0  # the round that saved it, and
    saved: float = 0.0  # when (wall clock): which of two holdings is newer, as ``checkpoints``

    @property
    def age(self) -> tuple[int, float, str]:
        """The order of checkpoints: the newer one's is greater."""
        return self.round, self.saved, self.checkpoint


def newest(holdings: Iterable[Holding | None]) -> Holding | None:
    """The newest checkpoint of ``holdings`` (None where there is none): the one a round's
    members agree to load, and to place their ranks for."""
    return max((h for h in holdings if h is not None), key=lambda h: h.age, default=None)


def holding(found: Iterable[Manifest], node: str) -> Holding | None:
    """What ``node`` holds of the newest complete DCP checkpoint; None where nothing."""
    latest = latest_complete(found)
    if latest is None:
        return None
    ranks = {r for m in latest.shares.values() if node in (m.node, m.copied_to) for r in m.ranks}
    if not ranks:
        return None
    return Holding(latest.id, latest.world, tuple(sorted(ranks)), latest.round, latest.saved)


def to_delete(local: Iterable[str], found: Iterable[Manifest], writing: Iterable[str]) -> set[str]:
    """The entries of this node's directory (and its copies) to delete: those older than the
    newest complete checkpoint.  What is being written now (``writing``) is kept, as is any
    entry newer than it."""
    cps = [c for c in checkpoints(found) if c.kind == DCP]
    done = [c for c in cps if c.complete]
    if not done:
        return set()
    latest = done[-1]
    order = {c.id: i for i, c in enumerate(cps)}
    keep = {latest.id, *writing}
    return {
        name
        for name in local
        if name not in keep and name in order and order[name] < order[latest.id]
    }


def orphaned(
    copies: Mapping[tuple[str, str], float],
    found: Iterable[Manifest],
    landing: Iterable[tuple[str, str]],
) -> set[tuple[str, str]]:
    """The copies kept here (``(owner, checkpoint)`` -> when the last of it landed, this
    node's wall clock) that no manifest of any node names, to delete: their owner deleted
    its share (a save cut off by a failure) and its drop never came (the owner was lost
    first), or it never described them.  No restore reads them, and each holds a share's
    memory until the job ends, so they go once older than the newest complete checkpoint,
    a DCP one or a file a rank wrote itself (a job may save only files): landed before it
    was saved (a newer save's copy is sent after the newer save, so it lands after: the
    nodes' clocks are taken to agree to within the time between two saves, as the order of
    saves already takes them).  One landed since may be a save in flight whose owner has
    not published its manifest yet: kept, as is one still ``landing``."""
    found = list(found)
    done = [c.saved for c in checkpoints(found) if c.complete]
    if not done:
        return set()
    newest, named, keep = max(done), {m.id for m in found}, set(landing)
    return {
        key
        for key, landed in copies.items()
        if key[1] not in named and key not in keep and landed < newest
    }


def torn(
    local_dirs: Iterable[str], found: Iterable[Manifest], chosen: Checkpoint | None = None
) -> set[str]:
    """The DCP entries (directories) here that are not complete: what a restart deletes
    before the workers read, so that none of them loads a save that was cut off.  With
    ``chosen`` (the checkpoint the round agreed to restore), any newer one too: a member
    may have found it torn, and a script loads the newest it finds.  (Files a rank wrote
    itself are the script's to name; they are kept.)"""
    everything = checkpoints(found)
    files = {c.id for c in everything if c.kind == FILE}
    known = {c.id: c for c in everything if c.kind == DCP}
    order = [c.id for c in everything if c.kind == DCP]
    newer = set(order[order.index(chosen.id) + 1 :]) if chosen and chosen.id in order else set()
    return {
        name
        for name in local_dirs
        if name not in files and (name not in known or not known[name].complete or name in newer)
    }


def agreed(found: Iterable[Manifest], holding: Holding) -> Checkpoint | None:
    """The checkpoint ``holding`` names, where it is complete in ``found``."""
    for checkpoint in checkpoints(found):
        if (checkpoint.id, checkpoint.round) == (holding.checkpoint, holding.round):
            return checkpoint if checkpoint.complete and checkpoint.kind == DCP else None
    return None


def missing(checkpoint: Checkpoint, have: Mapping[str, int]) -> dict[str, FileFacts]:
    """The files of ``checkpoint`` this node lacks (``have``: file -> its size here)."""
    return {
        name: facts for name, facts in checkpoint.files().items() if have.get(name) != facts.size
    }


def fetch_order(holders: Iterable[str], here: str, members: Iterable[str]) -> list[str]:
    """Where to get a file from: this node, then the holders in the round's ``members``,
    then the others (each once, in the given order within each kind)."""
    inside = set(members)
    unique = list(dict.fromkeys(holders))
    return sorted(unique, key=lambda node: 0 if node == here else 1 if node in inside else 2)


def kept(manifests_here: Iterable[Manifest]) -> tuple[Manifest, ...]:
    """What a part carries: its newest DCP manifests, at most MAX_KEPT, and its newest
    files, at most MAX_KEPT_FILES.  Bounded apart: files a script writes beside each save
    (a data loader's state per rank) must not push its DCP checkpoint out of the record,
    where the other nodes would find it incomplete and delete it as torn."""
    ordered = sorted(manifests_here, key=lambda m: (m.round, m.saved, m.id))
    saves = [m for m in ordered if m.kind == DCP][-MAX_KEPT:]
    files = [m for m in ordered if m.kind == FILE][-MAX_KEPT_FILES:]
    return tuple(sorted(saves + files, key=lambda m: (m.round, m.saved, m.id)))


def with_copy(manifest: Manifest, node: str) -> Manifest:
    return replace(manifest, copied_to=node)


def summary(found: Iterable[Manifest]) -> dict[str, Any] | None:
    """What ``elasticctl status`` shows of a job's newest complete checkpoint."""
    checkpoint = latest_complete(found)
    if checkpoint is None:
        return None
    return {
        "id": checkpoint.id,
        "round": checkpoint.round,
        "world": checkpoint.world,
        "size": checkpoint.size,
        "saved": checkpoint.saved,
        "held": sorted(checkpoint.shares),
        "copies": {node: m.copied_to for node, m in sorted(checkpoint.shares.items())},
        "on_disk": checkpoint.on_disk,
    }
