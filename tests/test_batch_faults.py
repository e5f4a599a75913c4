"""A batch whose output breaks (a full disk, a corrupt line) fails alone, counts only what is on disk,
and comes back with `failover resume` once the cause is fixed (issue 11, item 7).

One real node (`failover up`, CPU, tiny model) with an online service and two batch services: one
writes to a 64 KiB tmpfs that fills up mid-batch, the other starts on an output with a corrupt line.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from conftest import small_tmpfs
from coserve_helpers import CoNode, batch_input, read_output
from supervisor_helpers import http, wait_until


def service(name: str, priority: int, **batch) -> dict:
    return {"name": name, "kind": "batch", "priority": priority, "standbys": 0, "kv_memory": "8MiB",
            "max_batch": 4, "batch": {"concurrency": 2, "watch": []} | batch}


@pytest.fixture
def small_fs(procs, run_dir):
    """A 64 KiB tmpfs with all but 8 KiB taken by a filler file; unmounted afterwards, once every
    process the test started is gone (an engine still writing there would keep it busy)."""
    with small_tmpfs(run_dir / "small") as mnt:
        (mnt / "filler").write_bytes(b"\0" * (56 << 10))
        yield mnt
        procs.stop_all()


def test_a_full_disk_or_a_corrupt_line_fails_only_that_batch_and_resume_retries_it(procs, tiny_model, run_dir,
                                                                                  small_fs):
    full_ids = batch_input(run_dir / "full.jsonl", 40, max_tokens=2, bad_lines=False)
    bad_ids = batch_input(run_dir / "bad.jsonl", 6, max_tokens=2, bad_lines=False)
    full_out, bad_out = small_fs / "out.jsonl", run_dir / "bad-out.jsonl"
    good = '{"id":"p0","response":{"status_code":200,"url":"/v1/completions","body":{}},"error":null}\n'
    bad_out.write_text(good + '{"id":"p1","respo\n' + good.replace('"p0"', '"p2"'))
    os.chmod(bad_out, 0o600)
    node = CoNode(procs, tiny_model, run_dir, [
        {"name": "chat", "kind": "online", "priority": 100, "standbys": 0, "kv_memory": "8MiB", "max_batch": 4},
        service("full", 10, input=str(run_dir / "full.jsonl"), output=str(full_out)),
        service("bad", 5, input=str(run_dir / "bad.jsonl"), output=str(bad_out)),
    ])
    try:
        # the corrupt output: that batch alone is failed, with the file, the line and what to do
        bad = node.batch("bad")
        assert bad["state"] == "failed"
        assert bad["why"] == (f"line 2 of batch output {bad_out} is not a result record (not JSON at "
                              f"column 12: Unterminated string starting at): remove or fix line 2 of {bad_out}, "
                              "then `failover resume bad`")
        # the full disk: failed with the file and the free space; only whole lines count as done
        full = wait_until(lambda: (b := node.batch("full"))["state"] == "failed" and b, 120, "the disk to fill")
        assert f"cannot write batch output {full_out}: No space left on device" in full["why"]
        assert "bytes free there" in full["why"] and "`failover resume full`" in full["why"]
        data = full_out.read_bytes()
        assert data.endswith(b"\n") and full["done"] == len(read_output(full_out)) < len(full_ids)
        wait_until(lambda: node.slot("full-0")["state"] == "stopped", 30, "the failed batch's engine stopped")
        code, doc = http("GET", node.url + "/ready")  # a failed batch job leaves the router in rotation
        assert code == 200 and doc["services"]["chat"] and doc["services"]["full"] is False, doc
        code, doc = http("POST", node.url + "/v1/completions",  # online serving goes on meanwhile
                         {"model": "chat", "prompt": "still here", "max_tokens": 2, "temperature": 0})
        assert code == 200 and doc["choices"], doc

        res = node.cli("resume", "bad")  # not fixed yet: refused, with the reason, non-zero exit
        assert res.returncode == 1 and f"line 2 of batch output {bad_out}" in res.stderr, res.stderr
        bad_out.write_text(good + good.replace('"p0"', '"p2"'))
        res = node.cli("resume", "bad")
        assert res.returncode == 0, res.stderr
        wait_until(lambda: node.batch("bad")["state"] == "done", 90, "the fixed batch done")

        (small_fs / "filler").unlink()  # space freed: the failed batch goes on from its last whole line
        res = node.cli("resume", "full")
        assert res.returncode == 0, res.stderr
        wait_until(lambda: node.batch("full")["state"] == "done", 120, "the resumed batch done")
        assert node.status()["supervisor"]["failed"] == {}
    finally:
        node.stop()
    assert Counter(r["id"] for r in read_output(full_out)) == Counter(full_ids)
    assert Counter(r["id"] for r in read_output(bad_out)) == Counter(bad_ids)
