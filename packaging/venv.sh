#!/usr/bin/env bash
# Make, or bring up to date, the virtual environment (.venv, or $ELASTICD_VENV) with what the
# daemon, the CLI, the demo and the tests need.  Idempotent: a stamp remembers what it installed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${ELASTICD_VENV:-$root/.venv}
stamp=$venv/.elasticd-installed
want=$(cat "$root/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
echo "installing into $venv (torch 2.13.0 CPU, pyzmq, psutil, prometheus-client, sdnotify, cryptography, aetcd, pytest)" >&2
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q -e "$root[test]"
echo "$want" > "$stamp"
