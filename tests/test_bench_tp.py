"""``bench/engine.py --tp N`` on CPU (gloo): its tp=2 server really runs two rank processes, and its
greedy token ids at every batch equal tp=1's; nothing of either server is left afterwards. The
decode speeds it prints are figures, not asserted."""

from __future__ import annotations

import os
import sys
from argparse import Namespace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "bench") not in sys.path:
    sys.path.append(str(REPO / "bench"))  # last: bench/engine.py must not shadow the engine package

from engine_tp import bench_tp_decode  # noqa: E402
from failover.coserve.release import descendants  # noqa: E402


def _children_of_this_process() -> set[int]:
    return set(descendants(os.getpid()))


def test_bench_tp2_starts_two_ranks_and_gets_tp1_greedy_ids(tiny_model, tmp_path):
    before = _children_of_this_process()
    args = Namespace(tp=2, tp_batches="1,3", device="cpu", kv_gib=1, no_graphs=True, prompt_len=5,
                     new_tokens=6, runs=1)
    r = bench_tp_decode(tiny_model, args, tmp_path)
    assert r["ranks"] == {1: 1, 2: 2}
    assert set(r["ids"][2]) == {1, 3} and all(len(ids) == 6 for ids in r["ids"][2][3])
    assert r["tokens_equal_tp1"] == 1, (r["ids"][1], r["ids"][2])
    assert all(v > 0 for tp in (1, 2) for v in r["tok_s"][tp].values())
    assert _children_of_this_process() <= before  # both servers and the tp=2 worker are gone
