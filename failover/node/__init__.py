"""One node: the supervisor, its instance slots, its run dir, the cache daemon's handle and the bridge
to the in-process router."""
