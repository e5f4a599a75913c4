"""The reference engine: an OpenAI-compatible server for the Llama family that maps its weights from
the cache daemon (or reads them from disk). See docs/engine.md; ``engine.cli.main`` is the entry point."""
