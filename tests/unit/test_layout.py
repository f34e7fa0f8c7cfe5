"""The layout's rules (docs/architecture.md): every import arrow points down the tiers, no
import goes in a circle (not even one inside a function or under TYPE_CHECKING), and no
module reaches for another module's private names.  They read the source (stdlib ast),
importing nothing."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DAEMON = ROOT / "daemon" / "elasticd"

# The daemon's rooms, lowest tier first.  A module may import its own room and the rooms of
# lower tiers, never a room of its own tier or above.  A module belongs to the room of the
# longest prefix that names it; every module must belong to one.
ROOMS: dict[str, tuple[int, tuple[str, ...]]] = {
    "wire": (0, ("elasticd.wire",)),
    "leaves": (
        1,
        (
            "elasticd",
            "elasticd.errors",
            "elasticd.faults",
            "elasticd.aio",
            "elasticd.journal",
            "elasticd.endpoint",
            "elasticd.trust",
        ),
    ),
    "elastic": (1, ("elasticd.elastic",)),
    "store": (2, ("elasticd.store",)),
    "core": (
        3,
        (
            "elasticd.core",
            "elasticd.rendezvous",
            "elasticd.rendezvous.state",
            "elasticd.rendezvous.ops",
            "elasticd.rendezvous.locality",
        ),
    ),
    "jobs": (4, ("elasticd.jobs",)),
    "shell": (
        5,
        (
            "elasticd.shell",
            "elasticd.rendezvous.handler",
            "elasticd.rendezvous.joinlog",
            "elasticd.rendezvous.keys",
        ),
    ),
    "config": (6, ("elasticd.config", "elasticd.metrics")),
    "cluster": (7, ("elasticd.cluster",)),
    "control": (8, ("elasticd.control",)),
    "app": (
        9,
        (
            "elasticd.app",
            "elasticd.__main__",
            "elasticd.cleanup",
            "elasticd.keygen",
            "elasticd.private",
        ),
    ),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(DAEMON.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str:
    best, length = None, -1
    for room, (_, prefixes) in ROOMS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                if prefix == "elasticd" and module != "elasticd":
                    continue  # the package itself (its version), not everything in it
                best, length = room, len(prefix)
    assert best is not None, (
        f"{module} is in no room of test_layout.ROOMS: give it one (and docs/architecture.md's figure)"
    )
    return best


def imported(path: Path, module: str) -> set[str]:
    """The elasticd modules (or packages) that ``path`` imports, absolute."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                is_module = (DAEMON.parent / Path(*full.split("."))).with_suffix(
                    ".py"
                ).exists() or (DAEMON.parent / Path(*full.split("."))).is_dir()
                found.add(full if is_module else base)
    return {name for name in found if name == "elasticd" or name.startswith("elasticd.")}


def test_every_import_arrow_points_down_the_tiers():
    upward = []
    for path in sorted(DAEMON.rglob("*.py")):
        module = module_name(path)
        room = room_of(module)
        tier = ROOMS[room][0]
        for target in sorted(imported(path, module)):
            other = room_of(target)
            if other != room and ROOMS[other][0] >= tier:
                upward.append(
                    f"{module} ({room}, tier {tier}) imports {target} ({other}, tier {ROOMS[other][0]})"
                )
    assert not upward, "imports pointing up:\n" + "\n".join(upward)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(DAEMON.rglob("*.py"))}


def test_no_import_goes_in_a_circle():
    """Tarjan's strongly connected components over every import of every module, wherever
    it is written: a circle held together by imports inside functions is still a circle."""
    graph = {module: imported(path, module) for module, path in modules().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == module:
                    break
            if len(component) > 1 or module in graph.get(module, ()):
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert not circles, "imports in a circle:\n" + "\n".join(" <-> ".join(c) for c in circles)


NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}  # public names


def private_names(tree: ast.AST) -> set[str]:
    """The private names (``_x``, not dunders) a module defines: its functions, classes and
    methods, and the attributes it assigns (``self._x = ...``, class-level ``_x = ...``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_no_module_uses_another_modules_private_names():
    """``x._name`` where ``_name`` is defined by another of our modules and not by this one,
    or ``from elasticd... import _name``: modules talk through public names.  (Private
    names of other libraries are not ours to police here.)"""
    trees = {module: ast.parse(path.read_text(), str(path)) for module, path in modules().items()}
    defined = {module: private_names(tree) for module, tree in trees.items()}
    ours = set().union(*defined.values()) - NAMEDTUPLE_API
    reaching = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("elasticd"):
                reaching += [
                    f"{module}: from {node.module} import {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
            elif (
                isinstance(node, ast.Attribute)
                and node.attr in ours
                and node.attr not in defined[module]
            ):
                reaching.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert not reaching, "private names used from another module:\n" + "\n".join(reaching)


def test_the_cli_imports_only_the_wire_of_the_daemon():
    """What the CLI may import of elasticd is wire/ (and the package's version); wire/ itself
    imports nothing of elasticd outside it (test_cli_imports checks the same at run time)."""
    wrong = []
    for path in sorted((ROOT / "ctl" / "elasticctl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "elasticd":
                names = [
                    f"elasticd.{alias.name}" for alias in node.names if alias.name != "__version__"
                ]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            wrong += [
                f"{path.name}: {name}"
                for name in names
                if name.startswith("elasticd.") and not name.startswith("elasticd.wire")
            ]
    assert not wrong, wrong


def test_every_room_names_modules_that_exist():
    """A room's prefixes name real modules or packages, so that a rename cannot leave the
    table guarding nothing."""
    for room, (_, prefixes) in ROOMS.items():
        for prefix in prefixes:
            path = DAEMON.parent / Path(*prefix.split("."))
            assert path.is_dir() or path.with_suffix(".py").exists(), f"{room}: {prefix}"


def test_no_two_test_modules_share_a_name() -> None:
    """pytest imports test modules by their basename (rootdir conftests, no packages): two
    of one name in different folders fail the collection of whichever comes second."""
    seen: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a module name"
        seen[path.name] = path
