"""failover.procs.smaps: the daemon's arena pages in a process tree, shared or private; and the
fingerprint's engine fields, diffed one setting per line (no vLLM needed)."""

from __future__ import annotations

import mmap
import os
import signal

import msgspec
import torch

from cache_daemon.arena_cpu import CpuArenaWriter, CpuMapping
from cache_daemon.fingerprint import CacheConfig
from failover.procs.smaps import tree_memory

SIZE = 4 << 20


def test_an_arena_mapped_by_two_processes_counts_half_in_each_ones_pss():
    writer = CpuArenaWriter(SIZE, "smaps-test")
    writer.write(0, torch.ones(SIZE // 4))
    fd = writer.seal()
    mapping = CpuMapping(fd, SIZE)
    mapping.flat().sum()  # every page resident in this process
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child maps the same memfd and reads every page (no torch op after a fork)
        try:
            child = mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            child.read(SIZE)
            os.write(w, b"x")
            signal.pause()
        finally:
            os._exit(0)
    try:
        assert os.read(r, 1) == b"x"
        mine = tree_memory([os.getpid()])["arena"]
        both = tree_memory([os.getpid(), pid])["arena"]
        assert mine["Rss"] >= SIZE and mine["Private_Clean"] + mine["Private_Dirty"] == 0, mine
        assert abs(mine["Pss"] - SIZE // 2) <= 64 << 10, mine  # each page counted 1/2 in each process
        assert abs(both["Pss"] - SIZE) <= 64 << 10, both  # once in all
        assert tree_memory([os.getpid()])["total"]["Rss"] > mine["Rss"]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)
        mapping.close()
        writer.close()
        os.close(fd)


def test_a_fingerprint_diff_names_each_differing_engine_setting():
    base = dict(model_path="/m", model_identity="i", revision="", architecture="LlamaForCausalLM", dtype="float32",
                tp_size=1, tp_rank=0, quant_method="none", quant_hash="h", transform="none", transform_version=1,
                device="cpu", device_capability="", torch_version="2.13.0", engine="vllm", engine_version="0.32.0",
                engine_config=(("dtype", "float32"), ("quantization", "none")))
    a = CacheConfig(**base)
    b = msgspec.structs.replace(a, dtype="bfloat16", engine_version="0.33.0",
                                engine_config=(("dtype", "bfloat16"), ("kv_cache_dtype", "fp8"), ("quantization", "none")))
    assert a.diff(b) == ["dtype: 'float32' != 'bfloat16'", "engine_version: '0.32.0' != '0.33.0'",
                         "engine_config.dtype: 'float32' != 'bfloat16'",
                         "engine_config.kv_cache_dtype: '<unset>' != 'fp8'"]
    assert hash(a) != hash(b) and a.diff(a) == []
