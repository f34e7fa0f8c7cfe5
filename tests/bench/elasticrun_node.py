"""``elasticrun`` as a module, for node_launcher.py (the package's entry point is a script)."""

import sys

from elasticctl.cli import elasticrun

sys.exit(elasticrun())
