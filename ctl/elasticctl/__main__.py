import sys

from elasticctl.cli import main

sys.exit(main())
