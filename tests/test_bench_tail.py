"""bench/loadgen.py's ``tail``: who the slowest 1 % of a run's answered requests were, so a p99 read
off one side by side says whether the kills made it (bench/vs_haproxy.py prints it per proxy)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "bench") not in sys.path:
    sys.path.append(str(REPO / "bench"))  # last: bench/engine.py and bench/failover.py must not shadow the packages

from loadgen import CALM_S, Outcome, tail  # noqa: E402


def test_the_slowest_hundredth_is_placed_against_the_faults():
    calm = [Outcome(start=i * 0.01, end=i * 0.01 + 0.02, ok=True, stream=False, chat=False) for i in range(197)]
    fault = 10.0
    near = [Outcome(start=fault + 0.1, end=fault + 0.5, ok=True, stream=True, chat=False, instance="b"),
            Outcome(start=fault + 0.3, end=fault + 0.6, ok=True, stream=False, chat=False)]
    late = Outcome(start=fault + CALM_S + 1.0, end=fault + CALM_S + 1.25, ok=True, stream=True, chat=False)
    failed = Outcome(start=fault, end=fault + 5.0, ok=False, stream=True, chat=False, error="ClientPayloadError")
    t = tail(calm + near + [late, failed], [fault])
    assert t["n"] == 2  # 200 answered: the slowest two; the failed one is not an answer
    assert t["near_fault"] == 2 and t["streams"] == 1
    assert t["from_ms"] == 300.0
    assert t["worst"] == {"ms": 400.0, "began_after_fault_ms": 100.0, "stream": True, "instance": "b"}


def test_a_tail_before_any_fault_and_an_empty_run():
    slow = Outcome(start=0.0, end=1.0, ok=True, stream=False, chat=False)
    t = tail([slow], [5.0])
    assert t["near_fault"] == 0 and t["worst"]["began_after_fault_ms"] is None
    assert tail([], [1.0]) == {}
    assert tail([Outcome(start=0, end=1, ok=False, stream=False, chat=False)], []) == {}
