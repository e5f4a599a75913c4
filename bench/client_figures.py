"""The benches' name for failover_common/client_figures.py: the one helper that computes what clients
saw around each fault (``failover demo`` uses it too, so it lives in the package)."""

from failover_common.client_figures import *  # noqa: F401,F403
from failover_common.client_figures import __all__  # noqa: F401
