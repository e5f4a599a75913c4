"""failover_common/client_figures.py (bench/client_figures.py to the benches): the client-seen figures
every failover bench and ``failover demo`` print, on records whose answer is known by hand."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "bench") not in sys.path:
    sys.path.append(str(REPO / "bench"))  # last: bench/engine.py and bench/failover.py must not shadow the packages

import client_figures as bench_name  # noqa: E402
from failover_common.client_figures import (fault_figures, one_fault, percentile, requests_summary,  # noqa: E402
                                            stall_span, summarize)


@dataclass
class Rec:
    start: float
    end: float
    ok: bool
    stream: bool
    tokens: list[float] = field(default_factory=list)


def test_one_crash_of_two_streams_and_a_request():
    # fault at t=10. Stream a: tokens 9.0, 9.5, then (migrated) 10.8, 11.0, ends 11.1.
    # Stream b: sent 9.9, no token before the fault, first token at 10.4, ends 10.5.
    # Non-stream c: sent 9.8, answered at 10.6. Non-stream d: finished at 9.7 (not in flight).
    records = [Rec(8.9, 11.1, True, True, [9.0, 9.5, 10.8, 11.0]),
               Rec(9.9, 10.5, True, True, [10.4]),
               Rec(9.8, 10.6, True, False),
               Rec(9.0, 9.7, True, False)]
    f = one_fault(records, 10.0)
    assert f.first_token_ms == pytest.approx(400.0)  # b's first token at 10.4
    assert f.worst_wait_ms == pytest.approx(800.0)  # a waited 10.0 -> 10.8
    assert f.longest_stall_ms == pytest.approx(1300.0)  # a: 9.5 -> 10.8 (b: 9.9 -> 10.4 = 500)
    assert stall_span(records[0], 10.0) == (9.5, 10.8)
    assert (f.inflight, f.failed) == (3, 0)


def test_a_failed_request_waits_until_its_end_and_counts_as_failed():
    records = [Rec(9.0, 12.0, False, True, [9.5]),  # broken stream: error at 12.0
               Rec(9.9, 10.2, True, False)]
    f = one_fault(records, 10.0)
    assert f.first_token_ms == pytest.approx(200.0)
    assert f.worst_wait_ms == pytest.approx(2000.0)  # no next token: its end
    assert f.longest_stall_ms == pytest.approx(2500.0)  # 9.5 -> 12.0
    assert (f.inflight, f.failed) == (2, 1)


def test_a_fault_nobody_recovered_from():
    f = one_fault([Rec(1.0, 2.0, True, False)], 5.0)
    assert f.first_token_ms is None and f.worst_wait_ms is None and f.longest_stall_ms is None
    assert summarize([f])["faults_without_progress"] == 1


def test_summary_over_faults_is_p50_p99_max():
    # one stream per fault, each waiting k*100 ms after its fault at 10*k: first token k*100 ms
    records, faults = [], []
    for k in range(1, 21):
        t = 10.0 * k
        records.append(Rec(t - 0.5, t + k / 10 + 0.01, True, True, [t - 0.4, t + k / 10]))
        faults.append(t)
    s = summarize(fault_figures(records, faults))
    assert s["faults"] == 20 and s["inflight_at_faults"] == 20 and s["failed_inflight_at_faults"] == 0
    assert s["first_token_ms"] == {"p50": pytest.approx(1100.0), "p99": pytest.approx(2000.0),
                                   "max": pytest.approx(2000.0)}
    # the stall of fault k is from the token at t-0.4 to t+k/10
    assert s["longest_stall_ms"]["max"] == pytest.approx(2400.0)
    assert s["longest_stall_ms"]["p50"] == pytest.approx(1500.0)


def test_whole_run_counts():
    records = [Rec(0.0, 3.0, True, True, [1.0, 1.2]), Rec(0.0, 1.0, False, True, []), Rec(0.0, 0.5, False, False)]
    r = requests_summary(records)
    assert r == {"requests": 3, "failed": 2, "broken_streams": 1, "longest_stream_stall_ms": 1800.0}


def test_percentile_nearest_rank():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(100)), 99) == 98
    assert math.isnan(percentile([], 50))


def test_the_benches_use_the_same_helper():
    assert bench_name.fault_figures is fault_figures and bench_name.summarize is summarize
