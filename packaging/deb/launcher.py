#!/usr/bin/python3 -I
"""@NAME@, as the Debian package installs it (packaging/build-deb).

The package's code and the libraries it carries (built for Python @PYVER@) live in
/usr/lib/elasticd.  @NAME@ runs under Debian's /usr/bin/python3, or under $ELASTICD_PYTHON
when that names another Python @PYVER@ (a venv that only root can change).
"""

import os
import re
import sys

LIB = "/usr/lib/elasticd"
PYVER = "@PYVER@"
SYSTEM = ("/usr", "/usr/local")  # the system's own Python: root's by construction
_PATH_LITERAL = re.compile(r"""['"](/[^'"\n]*)['"]""")  # an absolute path in Python source
_IMPORTED = re.compile(r"""(?:^|;)\s*(?:import|from)\s+([\w.]+)|__import__\(\s*['"]([\w.]+)['"]""")


def refuse(message: str) -> None:
    """A problem of configuration: exit 2, which elasticd.service does not restart."""
    print(f"@NAME@: {message}", file=sys.stderr)
    sys.exit(2)


class Scan:
    """What someone other than root could change, among a Python prefix (a venv), the
    directories above it, everything under it, and what its symlinks lead to and its .pth
    files name (the directories they add, and the absolute paths in their ``import`` lines
    and in the modules those import from the same directory).  Run as root, the daemon
    executes what is there: a venv that a job's user can write to would hand that user root.
    Each step is judged by elasticd.trust (root's, and writable by nobody else)."""

    def __init__(self, trust) -> None:
        self._trust = trust
        self._seen: set[str] = set()

    def prefix(self, top: str) -> str | None:
        return self.path(top)

    def path(self, path: str) -> str | None:
        """``path`` (every step from /, links followed) and, if a directory, all under it."""
        walk = True
        while not os.path.lexists(path):  # a missing one: whoever may make it there
            path = os.path.dirname(path)
            walk = False
        problem = self._trust.loose_step(path, frozenset({0}))
        real = os.path.realpath(path)
        if problem or not walk or real in SYSTEM + ("/",) or real in self._seen:
            return problem
        self._seen.add(real)
        if not os.path.isdir(real):
            return None
        problem = _shared_dir(real)
        for folder, dirs, files in os.walk(real):
            problem = problem or next(filter(None, (self._entry(os.path.join(folder, name))
                                                    for name in dirs + files)), None)
            if problem:
                return problem
            dirs[:] = [name for name in dirs if os.path.join(folder, name) not in self._seen]
            self._seen.update(os.path.join(folder, name) for name in dirs)  # walked once
        return None

    def _entry(self, path: str) -> str | None:
        folder, name = os.path.split(path)
        problem = self._trust.loose_entry(path, frozenset({0})) or _shared_dir(path)
        if problem is None and os.path.islink(path):
            problem = self.path(path)
        if problem is None and name.endswith(".pth"):  # site.py reads it as if it were here
            problem = self._pth(folder, path)
        if problem is None and name == "sitecustomize.py":  # imported at every start
            problem = self._source(folder, path)
        return problem

    def _pth(self, folder: str, pth: str) -> str | None:
        """A .pth file's directories (site.py adds those that exist) and import lines."""
        try:
            with open(pth, encoding="utf-8", errors="replace") as file:
                lines = file.read().splitlines()
        except OSError as err:
            return f"{pth}: {err.strerror}"
        for line in lines:
            if line.startswith(("import ", "import\t")):
                problem = self._code(folder, line, follow=True)
            elif line.strip() and not line.startswith("#"):
                problem = self.path(os.path.join(folder, line.rstrip()))
            else:
                problem = None
            if problem:
                return f"{problem} (named by {pth})"
        return None

    def _code(self, folder: str, code: str, follow: bool) -> str | None:
        """The absolute paths in ``code``, and those of the modules it imports from ``folder``."""
        for literal in _PATH_LITERAL.findall(code):
            problem = self.path(literal)
            if problem:
                return problem
        modules = {a or b for a, b in _IMPORTED.findall(code)} if follow else set()
        for module in sorted(modules):
            source = os.path.join(folder, module.split(".")[0] + ".py")
            problem = self._source(folder, source) if os.path.isfile(source) else None
            if problem:  # not a module of this directory: a package (walked) or the stdlib
                return problem
        return None

    def _source(self, folder: str, source: str) -> str | None:
        try:
            with open(source, encoding="utf-8", errors="replace") as file:
                return self._code(folder, file.read(), follow=False)
        except OSError as err:
            return f"{source}: {err.strerror}"


def _shared_dir(path: str) -> str | None:
    """A directory whose entries count may not be writable even with the sticky bit (which
    elasticd.trust allows only on the way: anyone may add a module to a sticky directory)."""
    if os.path.isdir(path) and not os.path.islink(path) and os.lstat(path).st_mode & 0o022:
        return f"{path} is a directory others can add files to"
    return None


def writable_by_others(top: str) -> str | None:
    """The first thing under, above or named from ``top`` that someone other than root could
    change, and how (see Scan); None if there is none."""
    sys.path.insert(0, f"{LIB}/lib")
    try:
        from elasticd import trust
    finally:
        del sys.path[0]
    return Scan(trust).prefix(top)


python = os.environ.get("ELASTICD_PYTHON", "") if @HONOURS_PYTHON@ else ""
if python and os.environ.pop("ELASTICD_LAUNCHED_BY", "") != python:  # once, not in a loop
    os.environ["ELASTICD_LAUNCHED_BY"] = python
    if os.geteuid() == 0:
        venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
        real = os.path.realpath(python)  # the interpreter a venv's bin/python3 links to
        unsafe = (writable_by_others(venv)
                  or writable_by_others(os.path.dirname(os.path.dirname(real))))
        if unsafe:
            refuse(f"ELASTICD_PYTHON={python} is not root's alone: {unsafe}; the daemon runs "
                   f"as root, so its Python must be a venv only root can change")
    try:
        os.execv(python, [python, "-I", __file__, *sys.argv[1:]])
    except OSError as err:
        refuse(f"ELASTICD_PYTHON={python}: {err.strerror}")
if "%d.%d" % sys.version_info[:2] != PYVER:
    refuse(f"{sys.executable} is Python {sys.version.split()[0]}, but this package's libraries "
           f"are built for Python {PYVER}; rebuild it with packaging/build-deb "
           f"--python-version {sys.version_info[0]}.{sys.version_info[1]}")
sys.path[:0] = [f"{LIB}/lib", f"{LIB}/vendor"]

from @MODULE@ import @FUNCTION@  # noqa: E402

sys.exit(@FUNCTION@())
