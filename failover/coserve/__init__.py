"""Co-serving: batch services on spare memory, their jobs, eviction, policy, files and runner."""
