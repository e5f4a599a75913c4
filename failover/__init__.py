"""failover: active-standby LLM serving with resident weights and sub-second promotion."""

__version__ = "0.1.0"  # keep equal to pyproject.toml's [project] version (tests/test_packaging.py checks)
