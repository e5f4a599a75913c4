"""One node: the supervisor, the start of one slot's engine, the cache daemon's handle, the run dir and
the bridge to the in-process router."""
