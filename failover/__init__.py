"""failover: active-standby LLM serving with resident weights and sub-second promotion."""
