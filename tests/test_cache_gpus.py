"""Device memory is keyed by GPU UUID: a process that sees every GPU and one that sees only its own
agree on which GPU an arena lives on (the enumeration is given here; tests/test_cache_cuda.py runs the
driver's on a GPU)."""

from __future__ import annotations

import msgspec
import pytest

from cache_daemon.client import local_ordinal
from cache_daemon.errors import ArenaError
from cache_daemon.gpus import format_uuid, ordinal_for
from cache_daemon.manifest import ArenaSpec, Manifest

NODE = tuple(format_uuid(bytes([i] * 16)) for i in range(4))  # a 4-GPU node, as the daemon pod sees it


def test_uuid_is_spelled_as_nvidia_smi_does():
    raw = bytes.fromhex("8a2c4f1e0b3d47a59c6e1f2a3b4c5d6e")
    assert format_uuid(raw) == "GPU-8a2c4f1e-0b3d-47a5-9c6e-1f2a3b4c5d6e"
    with pytest.raises(ValueError, match="16 bytes"):
        format_uuid(raw[:8])


def test_arena_key_round_trips_from_a_node_wide_process_to_a_one_gpu_pod():
    # the loader sees the whole node and fills GPU 3 (its ordinal 3)
    spec = ArenaSpec("cuda", 3, 4096, (4096,), NODE[3])
    wire = msgspec.msgpack.encode(Manifest(tensors=(), aliases={}, arenas=(spec,)))
    got = msgspec.msgpack.decode(wire, type=Manifest).arenas[0]
    assert got.device_uuid == NODE[3]
    # an engine pod given only GPU 3 sees it as its ordinal 0; one given GPUs 2 and 3, as 1
    assert local_ordinal(got, visible=(NODE[3],)) == 0
    assert local_ordinal(got, visible=(NODE[2], NODE[3])) == 1
    assert local_ordinal(got, visible=NODE) == 3
    # UUIDs compare case-insensitively (NVML and some tools print upper case)
    assert ordinal_for(NODE[3].upper(), (NODE[3],)) == 0


def test_a_pod_without_that_gpu_is_told_which_gpu_it_needs(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    spec = ArenaSpec("cuda", 3, 4096, (4096,), NODE[3])
    with pytest.raises(ArenaError) as err:
        local_ordinal(spec, visible=(NODE[0],))
    msg = str(err.value)
    assert NODE[3] in msg and NODE[0] in msg and "CUDA_VISIBLE_DEVICES='0'" in msg


def test_a_manifest_without_uuid_keeps_the_loaders_ordinal():
    assert local_ordinal(ArenaSpec("cuda", 2, 4096, (4096,)), visible=NODE) == 2
