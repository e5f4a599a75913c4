"""Tools for tests, benchmarks and the demo (not used by a running node)."""
