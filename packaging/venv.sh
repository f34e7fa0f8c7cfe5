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
echo "installing into $venv (torch 2.13.0 CPU, numpy, lightning, accelerate, pyzmq, psutil, prometheus-client, sdnotify, cryptography, aetcd, nvidia-ml-py, pytest, hypothesis, ruff, mypy, mkdocs-material)" >&2
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# NumPy beside torch: without it every `import torch` (each worker a job starts with this
# venv's python3) prints "Failed to initialize NumPy" to stderr.  2.4.6 is what pip resolves
# for Python 3.11 with torch 2.13.0 (built against NumPy 2); pinned like torch.
"$venv/bin/python" -m pip install -q torch==2.13.0 numpy==2.4.6
# The frameworks whose scripts the tests run under elasticd (tests/integration/test_lightning.py,
# test_accelerate.py) and whose integrations elasticd.elastic carries: exact versions, with
# torch named again so that their requirements never move it.
"$venv/bin/python" -m pip install -q torch==2.13.0 lightning==2.6.6 pytorch_lightning==2.6.6 \
    lightning_utilities==0.15.3 accelerate==1.15.0
"$venv/bin/python" -m pip install -q -e "$root[test]"
echo "$want" > "$stamp"
