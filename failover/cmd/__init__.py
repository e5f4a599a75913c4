"""The `failover` subcommands of this package: up, the admin clients, the demo."""
