"""Typed errors of the cache daemon, its client and the checkpoint reader.

Every error a caller may act on is a :class:`CacheError`. The engine's ``--weights auto`` falls back to
disk on :class:`DaemonUnavailable` alone; every other error means the daemon is there but cannot serve
this request, which is an operator problem to report, never a silent reload.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base of every error raised by ``cache_daemon``."""


class DaemonUnavailable(CacheError):
    """No daemon socket, or nobody listening on it: callers may fall back to a disk load."""


class AccessDenied(CacheError):
    """The daemon exists but refuses this process (socket permissions or its peer-uid policy)."""


class NotResident(CacheError):
    """The daemon is up but the requested model/rank is not loaded (yet, or at all)."""


class FingerprintMismatch(CacheError):
    """The daemon holds this model but with a different fingerprint; ``diff`` lists every field."""

    def __init__(self, message: str, diff: list[str]) -> None:
        super().__init__(message + ("\n  " + "\n  ".join(diff) if diff else ""))
        self.diff = list(diff)


class ProtocolError(CacheError):
    """A malformed, oversized, truncated or unexpected frame. ``code`` names the kind."""

    def __init__(self, message: str, code: str = "protocol") -> None:
        super().__init__(message)
        self.code = code


class ArenaError(CacheError):
    """Creating, exporting or mapping an arena failed (memfd, mmap or the CUDA driver)."""


class CheckpointError(CacheError):
    """The checkpoint directory cannot be served as asked; the message names file, tensor or field."""


class MissingShardError(CheckpointError):
    """A safetensors file named by the index is missing, or does not hold the tensors it should."""


class MissingTensorError(CheckpointError):
    """A tensor the model config requires is in none of the checkpoint files."""


class DtypeMismatchError(CheckpointError):
    """A tensor's dtype contradicts ``torch_dtype`` in config.json."""


class ShapeMismatchError(CheckpointError):
    """A tensor's shape contradicts the sizes in config.json."""


class TPSizeError(CheckpointError):
    """The tensor-parallel size does not divide a dimension that must be split."""


class UnknownTensorError(CheckpointError):
    """A tensor whose sharding rule is unknown: serving it replicated could be silently wrong."""
