"""What failover puts inside vLLM's own processes (through vLLM's plugin entry points)."""
