"""The node config: its schema (the TOML file), the machine checks before `failover up`, the argv of
each process the supervisor starts."""
