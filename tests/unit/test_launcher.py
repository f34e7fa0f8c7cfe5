"""The Debian package's launcher (packaging/deb/launcher.py) and its ELASTICD_PYTHON check
(docs/operations.md, "The Debian package"): a venv is refused when anything the daemon (root) would run from it
could be changed by someone else, .pth files, the directories they add, the paths in their
import lines and the links under it included.

The launcher is rendered from its template as packaging/build-deb renders it, with LIB
pointing at a directory of the test's own (the package's code and a probe module), and run
with ELASTICD_PYTHON naming venvs that the test builds from /usr/bin/python3.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "packaging" / "deb" / "launcher.py"
SYSTEM_PYTHON = "/usr/bin/python3"
NOBODY = pwd.getpwnam("nobody").pw_uid
PROBE = "import sys\n\ndef main():\n    print('probe ran in', sys.prefix)\n    return 0\n"

pytestmark = [
    pytest.mark.skipif(os.getuid() != 0, reason="the check runs as root only"),
    pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason="no /usr/bin/python3"),
]


def system_version() -> str:
    return subprocess.run(
        [SYSTEM_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.fixture
def base(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)  # root's alone (under /tmp, which is sticky and root's)
    return tmp_path


@pytest.fixture
def launcher(base: Path) -> Path:
    """The template rendered as build-deb does (NAME elasticd, honouring ELASTICD_PYTHON),
    calling probe.main from a LIB of the test's own."""
    lib = base / "lib"
    shutil.copytree(
        ROOT / "daemon" / "elasticd",
        lib / "lib" / "elasticd",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (lib / "lib" / "probe.py").write_text(PROBE)
    text = TEMPLATE.read_text()
    assert text.count('LIB = "/usr/lib/elasticd"\n') == 1
    text = text.replace('LIB = "/usr/lib/elasticd"\n', f'LIB = "{lib}"\n')
    for placeholder, value in (
        ("@NAME@", "elasticd"),
        ("@MODULE@", "probe"),
        ("@FUNCTION@", "main"),
        ("@HONOURS_PYTHON@", "True"),
        ("@PYVER@", system_version()),
    ):
        text = text.replace(placeholder, value)
    path = base / "elasticd"
    path.write_text(text)
    path.chmod(0o755)
    return path


def check(launcher: Path):
    """The rendered launcher's writable_by_others, without running its main part."""
    source = launcher.read_text().split("\npython = os.environ.get(", 1)[0]
    namespace: dict = {"__name__": "launcher"}
    exec(compile(source, str(launcher), "exec"), namespace)
    return namespace["writable_by_others"]


def venv(path: Path) -> Path:
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(path)], check=True)
    return next(path.glob("lib/python3*/site-packages"))


def loose_dir(path: Path) -> Path:
    """A directory that nobody (the user) owns and may write."""
    path.mkdir()
    os.chown(path, NOBODY, -1)
    return path


def launch(launcher: Path, python: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "PYTHON"))}
    return subprocess.run(
        [str(launcher)],
        env={**env, "ELASTICD_PYTHON": str(python)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_venv_of_roots_alone_is_run(launcher, base):
    venv(base / "venv")
    done = launch(launcher, base / "venv" / "bin" / "python3")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"probe ran in {base / 'venv'}\n"


def test_a_pth_naming_a_directory_nobody_can_write_is_refused_by_the_launcher(launcher, base):
    """Row 0f as filed: the check accepted it, and the daemon would import nobody's code."""
    site = venv(base / "venv")
    loose = loose_dir(base / "loose")
    (site / "extra.pth").write_text(f"# more modules\n{loose}\n")
    done = launch(launcher, base / "venv" / "bin" / "python3")
    assert done.returncode == 2 and "probe ran" not in done.stdout
    assert (
        f"elasticd: ELASTICD_PYTHON={base / 'venv' / 'bin' / 'python3'} is not root's alone: "
        f"{loose} belongs to nobody (uid {NOBODY}) (named by {site / 'extra.pth'})"
    ) in done.stderr


@pytest.mark.parametrize(
    "line",
    [
        "import sys; sys.path.insert(0, '{loose}')",
        'import site; site.addsitedir("{loose}/lib")',  # a missing path in nobody's directory
        "import os; exec(open('{loose}/code.py').read())",
    ],
)
def test_an_import_line_that_names_a_path_others_can_write_is_refused(launcher, base, line):
    site = venv(base / "venv")
    loose = loose_dir(base / "loose")
    (loose / "code.py").write_text("")
    (site / "hook.pth").write_text(line.format(loose=loose) + "\n")
    assert f"{loose} belongs to nobody" in check(launcher)(str(base / "venv"))


def test_a_module_that_an_import_line_runs_is_read_for_paths(launcher, base):
    """An editable install's finder: the .pth imports a module of site-packages that maps
    package names to source directories elsewhere."""
    site = venv(base / "venv")
    source = base / "src"
    source.mkdir()
    (site / "__editable__.pkg-1.0.pth").write_text(
        "import __editable___pkg_finder; __editable___pkg_finder.install()"
    )
    (site / "__editable___pkg_finder.py").write_text(f"MAPPING = {{'pkg': '{source}/pkg'}}\n")
    assert check(launcher)(str(base / "venv")) is None  # root's: accepted
    os.chown(source, NOBODY, -1)
    assert f"{source} belongs to nobody" in check(launcher)(str(base / "venv"))


def test_an_import_line_of_roots_alone_is_accepted(launcher, base):
    """setuptools' distutils-precedence.pth, as every pip-made venv has it."""
    site = venv(base / "venv")
    (site / "distutils-precedence.pth").write_text(
        "import os; var = 'SETUPTOOLS_USE_DISTUTILS'; enabled = os.environ.get(var, 'local') "
        "== 'local'; enabled and __import__('_distutils_hack').add_shim(); \n"
    )
    (site / "_distutils_hack").mkdir()
    (site / "_distutils_hack" / "__init__.py").write_text("def add_shim(): pass\n")
    assert check(launcher)(str(base / "venv")) is None
    assert launch(launcher, base / "venv" / "bin" / "python3").returncode == 0


def test_a_symlink_to_a_path_others_can_write_is_refused(launcher, base):
    site = venv(base / "venv")
    loose = loose_dir(base / "loose")
    (loose / "evil.py").write_text("")
    (site / "evil.py").symlink_to(loose / "evil.py")
    assert f"{loose} belongs to nobody" in check(launcher)(str(base / "venv"))
    (site / "evil.py").unlink()
    (site / "pkg").symlink_to(loose)  # a linked package directory
    assert f"{loose} belongs to nobody" in check(launcher)(str(base / "venv"))


def test_what_the_check_refused_before_it_still_refuses(launcher, base):
    site = venv(base / "venv")
    planted = site / "planted.pth"
    planted.write_text("")
    planted.chmod(0o666)
    assert check(launcher)(str(base / "venv")) == f"{planted} is writable by everyone"
    planted.chmod(0o644)
    os.chown(planted, NOBODY, -1)
    assert check(launcher)(str(base / "venv")) == f"{planted} belongs to nobody (uid {NOBODY})"
    planted.unlink()
    shared = site / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # sticky: fine on the way to a file, not as a place modules come from
    assert check(launcher)(str(base / "venv")) == f"{shared} is a directory others can add files to"
    shared.rmdir()
    base.chmod(0o775)
    assert check(launcher)(str(base / "venv")) == f"{base} is writable by its group"


def test_the_system_python_is_not_walked(launcher):
    assert check(launcher)("/usr") is None
    assert (
        sys.executable
    )  # the test's own interpreter is irrelevant: the launcher uses /usr/bin/python3
