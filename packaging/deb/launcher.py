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
python = os.environ.get("ELASTICD_PYTHON", "") if @HONOURS_PYTHON@ else ""
if python and os.environ.pop("ELASTICD_LAUNCHED_BY", "") != python:  # once, not in a loop
    os.environ["ELASTICD_LAUNCHED_BY"] = python
    try:
        os.execv(python, [python, "-I", __file__, *sys.argv[1:]])
    except OSError as err:
        sys.exit(f"@NAME@: ELASTICD_PYTHON={python}: {err.strerror}")
if "%d.%d" % sys.version_info[:2] != PYVER:
    sys.exit(f"@NAME@: {sys.executable} is Python {sys.version.split()[0]}, but this package's "
             f"libraries are built for Python {PYVER}; rebuild it with packaging/build-deb "
             f"--python-version {sys.version_info[0]}.{sys.version_info[1]}")
sys.path[:0] = [f"{LIB}/lib", f"{LIB}/vendor"]

from @MODULE@ import @FUNCTION@  # noqa: E402

sys.exit(@FUNCTION@())
