#!/usr/bin/python3 -I
"""@NAME@, as the Debian package installs it (packaging/build-deb).

The package's code and the libraries it carries (built for Python @PYVER@) live in
/usr/lib/elasticd.  @NAME@ runs under Debian's /usr/bin/python3, or under $ELASTICD_PYTHON
when that names another Python @PYVER@ (a venv with torch: the c10d store host needs one).
"""

import os
import sys

LIB = "/usr/lib/elasticd"
PYVER = "@PYVER@"


def refuse(message: str) -> None:
    """A problem of configuration: exit 2, which elasticd.service does not restart."""
    print(f"@NAME@: {message}", file=sys.stderr)
    sys.exit(2)


def writable_by_others(top: str) -> str | None:
    """A path under ``top`` (the interpreter's prefix: a venv) or above it that someone
    other than root could change, or None.  Run as root, the daemon executes what is there:
    a venv that a job's user can write to would hand that user root."""
    def loose(path: str) -> bool:
        st = os.lstat(path)
        return st.st_uid != 0 or bool(st.st_mode & 0o022 and not os.path.islink(path))
    path = top
    while True:  # the prefix and every directory above it
        if loose(path):
            return path
        if path == "/":
            break
        path = os.path.dirname(path)
    if top in ("/usr", "/usr/local"):  # the system's own Python: root's by construction
        return None
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            if loose(os.path.join(folder, name)):
                return os.path.join(folder, name)
    return None


python = os.environ.get("ELASTICD_PYTHON", "") if @HONOURS_PYTHON@ else ""
if python and os.environ.pop("ELASTICD_LAUNCHED_BY", "") != python:  # once, not in a loop
    os.environ["ELASTICD_LAUNCHED_BY"] = python
    if os.geteuid() == 0:
        venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
        real = os.path.realpath(python)  # the interpreter a venv's bin/python3 links to
        unsafe = writable_by_others(venv) or writable_by_others(os.path.dirname(real))
        if unsafe:
            refuse(f"ELASTICD_PYTHON={python}: {unsafe} is not root's alone (another owner, "
                   f"or group/world-writable); the daemon runs as root, so its Python must be "
                   f"a venv only root can change")
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
