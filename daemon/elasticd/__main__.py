import sys

from elasticd.app import main

sys.exit(main())
