"""The model fingerprint nodes compare: copies of one checkpoint agree, other content does not."""

from __future__ import annotations

import os
import shutil
import struct

from cache_daemon.fingerprint import model_identity
from failover.cluster.fingerprint import SAMPLE_BYTES, SAMPLES, content_identity, fingerprint


def copy(src, dst, mtime_s: int = 1):
    shutil.copytree(src, dst)
    for p in dst.iterdir():  # another node's copy: same bytes, other mtimes
        os.utime(p, ns=(mtime_s * 10**9, mtime_s * 10**9))
    return dst


def test_two_copies_of_one_checkpoint_agree_though_their_mtimes_differ(tiny_model, tmp_path):
    a, b = copy(tiny_model, tmp_path / "a"), copy(tiny_model, tmp_path / "node-b" / "models" / "x", 7)
    assert model_identity(a) != model_identity(b)  # the daemon's (per node) identity differs
    assert content_identity(a) == content_identity(b) == content_identity(tiny_model)
    fa = fingerprint(str(a), dtype="float32", tp=1, transform="none", device="cuda:0")
    fb = fingerprint(str(b), dtype="float32", tp=1, transform="none", device="cuda:3")
    assert fa["key"] == fb["key"] and fa["model"] != fb["model"]  # not the path, nor the device index
    assert fingerprint(str(a), dtype="bfloat16", tp=1, transform="none", device="cuda")["key"] != fa["key"]
    assert fingerprint(str(a), dtype="float32", tp=2, transform="none", device="cuda")["key"] != fa["key"]


def test_other_weights_config_or_size_change_it(tiny_model, tmp_path):
    base = content_identity(tiny_model)
    shard = sorted(p.name for p in tiny_model.iterdir() if p.name.endswith(".safetensors"))[0]

    c = copy(tiny_model, tmp_path / "cfg")
    (c / "config.json").write_text((c / "config.json").read_text().replace("}", ', "x": 1}', 1))
    assert content_identity(c) != base

    w = copy(tiny_model, tmp_path / "w")  # one weight byte, in the data (read whole: a small file)
    raw = bytearray((w / shard).read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n + 3] ^= 0xFF
    (w / shard).write_bytes(bytes(raw))
    assert content_identity(w) != base

    t = copy(tiny_model, tmp_path / "t")  # a truncated copy
    with open(t / shard, "r+b") as f:
        f.truncate((t / shard).stat().st_size - 4)
    assert content_identity(t) != base


def test_a_large_file_is_sampled_not_read_whole(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    big = tmp_path / "model.safetensors"
    header = b'{"__metadata__":{}}'
    size = 64 * SAMPLES * SAMPLE_BYTES
    with open(big, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(size)
    first = content_identity(tmp_path)
    with open(big, "r+b") as f:  # a byte at the very end: a sample covers it
        f.seek(size - 1)
        f.write(b"\x01")
    assert content_identity(tmp_path) != first
    second = content_identity(tmp_path)
    with open(big, "r+b") as f:  # a byte between two samples: unseen (an identity, not a checksum)
        f.seek(8 + len(header) + SAMPLE_BYTES + 10)
        f.write(b"\x01")
    assert content_identity(tmp_path) == second
