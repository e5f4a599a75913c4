"""The benches' name for failover/tools/client_figures.py: the one helper that computes what clients
saw around each fault (``failover demo`` uses it too, so it lives in the package)."""

from failover.tools.client_figures import *  # noqa: F401,F403
from failover.tools.client_figures import __all__  # noqa: F401
