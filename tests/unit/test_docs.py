"""The documentation stays true: the MkDocs site builds with no broken link, page or anchor;
the README stays a front page (under 25 KB, every relative link resolving, every docs page
on its map); the configuration page is what docs/gen_config.py renders from config.py; and
the architecture page's figure names exactly the rooms, tiers and folders that
test_layout.py holds the imports to."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_layout import DAEMON, ROOMS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
ARCHITECTURE = DOCS / "architecture.md"
README_LIMIT = 25_000  # bytes: the front page, not the manual


def test_the_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: a link to a missing page or anchor, a page left out of the
    nav, a snippet of README.md that is gone: each is a warning, and strict fails on it."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs-material is not installed (pip install -e '.[test]')")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q"]
        + ["-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=tmp_path,  # the config finds its files from its own directory, not the caller's
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    page = (site / "getting-started" / "index.html").read_text()
    assert "elasticd --standalone &amp;" in page, "the tour did not come in from README.md"


def test_the_readme_is_a_front_page():
    size = README.stat().st_size
    assert size < README_LIMIT, (
        f"README.md is {size} bytes: keep it under {README_LIMIT} (move the detail to docs/)"
    )


def github_slug(heading: str) -> str:
    """The anchor GitHub (and MkDocs' toc, for these headings) gives a Markdown heading."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    found = {github_slug(h) for h in re.findall(r"^#{1,6} (.+)$", markdown, re.M)}
    return found | set(re.findall(r'<a id="([^"]+)"', markdown))


def relative_links(markdown: str) -> list[str]:
    """Targets of inline Markdown links that are not URLs (code blocks left out)."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


def test_every_relative_link_of_the_readme_resolves():
    readme = README.read_text()
    links = relative_links(readme)
    assert links, "no relative link found: the reader is broken"
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = (README.parent / path) if path else README
        if not target.exists():
            broken.append(f"{link}: no {target.relative_to(ROOT)}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
            broken.append(f"{link}: no heading or id {anchor!r} in {target.relative_to(ROOT)}")
    assert not broken, "README.md links that lead nowhere:\n" + "\n".join(broken)


def test_the_readme_maps_every_docs_page():
    linked = {Path(link.partition("#")[0]).name for link in relative_links(README.read_text())}
    pages = {page.name for page in DOCS.glob("*.md")}
    assert pages <= linked, f"docs pages missing from README.md's map: {sorted(pages - linked)}"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_config", DOCS / "gen_config.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_page_is_generated_from_config_py():
    generator = load_generator()
    rendered = generator.render()
    assert (DOCS / "configuration.md").read_text() == rendered, (
        f"docs/configuration.md is stale: regenerate it with {generator.REGENERATE}"
    )
    from elasticd import config

    for dotted in config.documented_keys():
        assert f"| `{dotted}` |" in rendered, dotted


# -- the architecture's figure against the code -------------------------------------------------

FIGURE_ROOM = re.compile(r'^ *(\w+)\["tier (\d+) · (\w+): ([^"]+)"\] *$', re.M)
FIGURE_EDGE = re.compile(r"^ *(\w+) --> (\w+) *$", re.M)


def figure() -> str:
    found = re.search(r"^```mermaid\n(.*?)^```", ARCHITECTURE.read_text(), re.M | re.S)
    assert found, "docs/architecture.md has no mermaid figure"
    return found.group(1)


def module_of(token: str) -> str:
    """A figure's token as the module prefix test_layout.ROOMS writes: `core/` the package,
    `rendezvous/ops.py` a module, `__init__.py` the package elasticd itself."""
    if token == "__init__.py":
        return "elasticd"
    return "elasticd." + token.removesuffix("/").removesuffix(".py").replace("/", ".")


def test_the_architecture_figure_names_the_rooms_of_the_code():
    rooms = {}
    for node, tier, room, tokens in FIGURE_ROOM.findall(figure()):
        assert node == room, f"the figure's node {node} is labelled {room}"
        rooms[room] = (int(tier), tokens.split())
    assert set(rooms) == set(ROOMS), (
        f"rooms only in the figure: {sorted(set(rooms) - set(ROOMS))}; "
        f"only in test_layout.ROOMS: {sorted(set(ROOMS) - set(rooms))}"
    )
    for room, (tier, tokens) in rooms.items():
        assert tier == ROOMS[room][0], (
            f"{room}: tier {tier} in the figure, {ROOMS[room][0]} in code"
        )
        assert {module_of(t) for t in tokens} == set(ROOMS[room][1]), (
            f"{room}: the figure names {tokens}, test_layout.ROOMS {ROOMS[room][1]}"
        )
        for token in tokens:
            path = DAEMON / token
            assert path.is_dir() if token.endswith("/") else path.is_file(), (
                f"{room}: the figure names {token}, which daemon/elasticd/ does not have"
            )


def test_every_daemon_package_is_in_the_figure():
    named = {t for _, _, _, tokens in FIGURE_ROOM.findall(figure()) for t in tokens.split()}
    packages = {f"{p.parent.name}/" for p in DAEMON.glob("*/__init__.py")}
    assert packages <= named, f"packages the figure does not show: {sorted(packages - named)}"


def test_the_figures_arrows_point_down_the_tiers():
    tiers = {room: int(tier) for _, tier, room, _ in FIGURE_ROOM.findall(figure())}
    edges = [(a, b) for a, b in FIGURE_EDGE.findall(figure()) if a in tiers and b in tiers]
    assert edges, "the figure has no arrows between rooms"
    up = [f"{a} --> {b}" for a, b in edges if tiers[a] <= tiers[b]]
    assert not up, f"arrows that do not point down the tiers: {up}"
    reached = {b for _, b in edges}
    assert reached == set(tiers) - {"app"}, "every room but app is imported by one above it"


def test_the_architecture_table_lists_the_rooms():
    rows = re.findall(r"^\| (\d+) \| (\w+) \|", ARCHITECTURE.read_text(), re.M)
    assert {(room, int(tier)) for tier, room in rows} == {
        (room, tier) for room, (tier, _) in ROOMS.items()
    }
