"""What the daemon holds: per loaded rank, its fingerprint, manifest and arena fds.

Ownership: the registry owns every fd in it and closes them on :meth:`evict` and :meth:`close`.
Clients that mapped an arena keep their mapping after that; the memory is freed by the kernel (memfd)
or the driver (VMM) when the last fd and mapping are gone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgspec

from .errors import FingerprintMismatch, NotResident
from .fingerprint import CacheConfig
from .manifest import Manifest
from .protocol import ModelStatus


@dataclass(slots=True)
class Resident:
    config: CacheConfig
    manifest: Manifest
    fds: list[int]
    attached: int = 0


class Registry:
    def __init__(self) -> None:
        self._by_config: dict[CacheConfig, Resident] = {}

    def __len__(self) -> int:
        return len(self._by_config)

    def add(self, config: CacheConfig, manifest: Manifest, fds: list[int]) -> Resident:
        old = self._by_config.pop(config, None)
        if old is not None:
            _close(old.fds)
        resident = self._by_config[config] = Resident(config, manifest, list(fds))
        return resident

    def find(self, config: CacheConfig) -> Resident:
        """The resident for exactly ``config``; else NotResident, or FingerprintMismatch with the diff
        against the closest resident of the same model directory."""
        hit = self._by_config.get(config)
        if hit is not None:
            return hit
        same_model = [r for r in self._by_config.values() if r.config.model_path == config.model_path]
        if not same_model:
            held = ", ".join(sorted({r.config.model_path for r in self._by_config.values()})) or "nothing"
            raise NotResident(f"{config.describe()} is not resident (the daemon holds {held})")
        closest = min(same_model, key=lambda r: (len(config.diff(r.config)), r.config.tp_rank != config.tp_rank))
        raise FingerprintMismatch(f"the daemon holds {closest.config.describe()} with another fingerprint "
                                  "(requested != resident)", config.diff(closest.config))

    def evict(self, config: CacheConfig) -> int:
        resident = self.find(config)
        del self._by_config[config]
        _close(resident.fds)
        return resident.manifest.nbytes

    def status(self) -> list[ModelStatus]:
        return [ModelStatus(key=r.config.key, model_path=r.config.model_path, tp_rank=r.config.tp_rank,
                            tp_size=r.config.tp_size, device=r.config.device, dtype=r.config.dtype,
                            transform=r.config.transform, nbytes=r.manifest.nbytes, attached=r.attached)
                for r in self._by_config.values()]

    def fingerprints(self) -> list[dict]:
        return [msgspec.to_builtins(c) for c in self._by_config]

    def close(self) -> None:
        for r in self._by_config.values():
            _close(r.fds)
        self._by_config.clear()


def _close(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())
