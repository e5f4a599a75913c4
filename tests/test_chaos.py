"""The chaos soak, short: a whole node (``failover up``) under mixed load while at least ten seeded
faults hit every part of it once (bench/chaos.py; ``python3 bench/chaos.py --help`` for the long run).

Faults: SIGKILL and SIGSTOP/SIGCONT of the primary, the standby, the zygote, the cache daemon and
(once the supervisor runs batch services) the batch engine; garbage on the daemon's socket and on
the admin API. Clients: raw aiohttp and the official openai
SDK, completions and chat, streamed and not, plus clients that leave mid-stream on purpose.

Why every checked request must succeed, fault by fault:
- primary killed: the supervisor's pidfd tells the router at once; a request with no byte sent is
  retried on the standby, a stream with bytes sent is migrated (greedy, so the continuation is the
  same text); the client sees a pause, not an error;
- primary frozen: the active probe fails it (probe_timeout + interval ~ 1.2 s here); fencing aborts
  the attempts stuck on it, which then retry or migrate as above; a freeze shorter than detection is
  only a pause;
- standby, zygote, daemon killed or frozen: the primary serves on its own mapping meanwhile;
- batch engine killed or frozen: not on the online path at all (its requests are the batch
  runner's, re-sent after a cut-off, and checked apart: no id twice in its result file);
- garbage: the daemon and the router answer it (or hang up) and keep serving everyone else.
So the bound is zero, and a failed request is a bug, not chaos. (Quitters, the clients that leave on
purpose, are not counted; what they leave behind is: in-flight entries, engine sequences, files.)
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "bench") not in sys.path:
    sys.path.insert(0, str(REPO / "bench"))

import chaos  # noqa: E402
import chaos_faults  # noqa: E402
import chaos_report  # noqa: E402

pytestmark = pytest.mark.slow  # 55-80 s on a busy 2-core machine (startup, >= 40 s of faults, shutdown)


def test_chaos_soak_short(tiny_model, run_dir, tmp_path, procs):
    batch = chaos.batch_supported()  # a batch service (co-serving) and its engine's faults, once there is one
    kinds = chaos_faults.KINDS + (chaos_faults.BATCH_KINDS if batch else ())
    opts = chaos.Options(duration=40.0, fault_rate=22.0, seed=7, concurrency=6, min_faults=len(kinds), warmup=2.0,
                         batch="auto")
    report = asyncio.run(chaos.soak(opts, workdir=tmp_path, model=tiny_model, run_dir=run_dir,
                                    starter=procs.start))
    text = chaos_report.render(report)
    faults, requests = report["faults"], report["requests"]

    # at least ten faults, the first ones one of each kind (the schedule deals every kind first); a
    # batch engine may be out of the way (evicted) when its turn comes: then that fault is skipped
    assert faults["injected"] >= 10, text
    assert set(faults["by_kind"]) == set(chaos_faults.KINDS) | (set(faults["by_kind"]) & set(kinds)), text
    assert all(x.split(": ", 1)[0] in chaos_faults.BATCH_KINDS for x in faults["skipped"]), text
    assert not faults["problems"], text  # garbage answered as documented; node whole after each fault

    # no failure, every answer and stream equal to the uninterrupted greedy run (nothing repeated or
    # missing), from both client kinds
    assert requests["raw_aiohttp"] > 0 and requests["openai_sdk"] > 0 and requests["streams"] > 0, text
    assert requests["failed"] == 0, text
    assert report["blackout"]["n"] == faults["by_kind"]["kill:primary"]["n"] + faults["by_kind"]["freeze:primary"]["n"]

    # nothing leaked while it ran: no request held by the router or an engine once the load stopped,
    # daemon accounting at its baseline after every restart and every garbage connection
    assert report["quiesce"]["ok"], text
    assert all(c["ok"] for c in report["daemon"]["checks"]), text
    assert report["daemon"]["restarts_checked"] >= 1, text
    assert report["daemon"]["checks"][-1]["idle_connections"] == 0, text  # no garbage connection kept

    # nor after a clean shutdown: no process, socket, file, memfd or mapping of the arena
    shutdown = report["shutdown"]
    assert shutdown["exit_code"] == 0, text
    assert shutdown["processes"] == [] and shutdown["left_pids"] == [], text
    assert shutdown["run_dir_files"] == [] and not shutdown["run_dir_exists"], text
    assert shutdown["memfds"] == [] and shutdown["arena_mappings"] == [], text
    if batch:  # every batch request id at most once in its result file, however often its engine died
        assert report["batch"]["duplicates"] == 0 and report["batch"]["errors"] == 0, text
    assert report["passed"], text
