"""Per-node weight cache: load a checkpoint once, let every engine map it zero-copy and read-only.

Importing this package imports neither torch nor CUDA; the modules that need torch import it inside
the functions that use it, so the daemon process stays small and never holds a CUDA context.
"""
