import sys

from failover.cli import main

sys.exit(main())
