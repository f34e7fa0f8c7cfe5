"""elasticd: elastic, fault-tolerant distributed PyTorch jobs on a cluster of hosts.

This package must stay importable without torch: the CLI imports
the stdlib-only leaves ``elasticd.wire.protocol`` and
``elasticd.wire.paths`` and starts in well under 200 ms.
"""

__version__ = "0.1.0"
