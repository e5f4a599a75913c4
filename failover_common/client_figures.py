"""What clients saw around each fault, from their own records: the one place the benches compute it.

A record is one client request as the client saw it (any object with these attributes; loadgen's
``Outcome`` is one):

    start: float          monotonic time the request was sent
    end: float            monotonic time it ended (answer read, stream closed, or error)
    ok: bool              it completed with the right answer
    stream: bool
    tokens: list[float]   monotonic times of the events that carried tokens (streams); a
                          non-stream request gets none: its answer counts once, at ``end``, if ok

Per fault (a monotonic time), ``fault_figures`` gives:

    first_token_ms    fault -> the first token (or whole answer) any client received after it: the
                      blackout a client population sees. The killed engine sends nothing after its
                      death, so this is whoever took over.
    worst_wait_ms     over the requests in flight at the fault, the longest fault -> that request's
                      next token (its answer, for a non-stream; its end, for one that failed)
    longest_stall_ms  over the streams in flight at the fault, the longest gap between two
                      consecutive events of one stream (send, tokens, end) from its last event
                      before the fault on: the pause a reader of that stream saw
    inflight, failed  requests in flight at the fault, and how many of them failed

``summarize`` turns those into p50 / p99 / max over faults (nearest rank, like ``percentile``).
``failover demo`` and every failover bench (bench/failover.py, gpu_e2e.py, chaos.py) compute their
client figures here, and nowhere else (bench/client_figures.py is this module under the benches'
import name). The router's own record is a different figure (last good chunk of the old primary -> first good of
the new, on the router's clock, before the client's read): benches print it beside these.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

__all__ = ["FaultFigures", "Record", "as_dicts", "fault_figures", "line", "one_fault", "percentile", "progress",
           "requests_summary", "stall_span", "summarize"]


class Record(Protocol):
    start: float
    end: float
    ok: bool
    stream: bool
    tokens: list[float]


@dataclass(frozen=True, slots=True)
class FaultFigures:
    fault: float
    first_token_ms: float | None  # None: no client got anything after the fault
    worst_wait_ms: float | None  # None: nothing was in flight
    longest_stall_ms: float | None  # None: no stream was in flight
    inflight: int
    failed: int


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def progress(r: Record) -> list[float]:
    """When ``r`` gave its client something: each token event of a stream, a good answer's arrival."""
    if r.stream:
        return r.tokens
    return [r.end] if r.ok else []


def _next_after(times: Iterable[float], t: float) -> float | None:
    return min((x for x in times if x > t), default=None)


def stall_span(r: Record, fault: float) -> tuple[float, float]:
    """The longest gap (from, to) between consecutive events of stream ``r`` from its last event
    at/before ``fault`` on: where the pause a reader of that stream saw lies."""
    events = [r.start, *sorted(r.tokens), r.end]
    first = max(i for i, t in enumerate(events) if t <= fault)
    return max(zip(events[first:], events[first + 1:]), key=lambda ab: ab[1] - ab[0])


def _stall(r: Record, fault: float) -> float:
    a, b = stall_span(r, fault)
    return b - a


def one_fault(records: Sequence[Record], fault: float) -> FaultFigures:
    first = _next_after((t for r in records for t in progress(r)), fault)
    inflight = [r for r in records if r.start <= fault < r.end]
    waits = []
    for r in inflight:
        nxt = _next_after(progress(r), fault)
        waits.append((nxt if nxt is not None else r.end) - fault)
    stalls = [_stall(r, fault) for r in inflight if r.stream]
    return FaultFigures(
        fault=fault,
        first_token_ms=None if first is None else (first - fault) * 1e3,
        worst_wait_ms=max(waits) * 1e3 if waits else None,
        longest_stall_ms=max(stalls) * 1e3 if stalls else None,
        inflight=len(inflight), failed=sum(1 for r in inflight if not r.ok))


def fault_figures(records: Sequence[Record], faults: Iterable[float]) -> list[FaultFigures]:
    return [one_fault(records, f) for f in faults]


def _pct(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    return {"p50": round(percentile(values, 50), 1), "p99": round(percentile(values, 99), 1),
            "max": round(max(values), 1)}


def summarize(figures: Sequence[FaultFigures]) -> dict:
    """p50 / p99 / max over faults of each per-fault figure, plus the counts (``faults_without_progress``:
    faults after which no client received anything at all)."""
    out = {"faults": len(figures),
           "faults_without_progress": sum(1 for f in figures if f.first_token_ms is None),
           "inflight_at_faults": sum(f.inflight for f in figures),
           "failed_inflight_at_faults": sum(f.failed for f in figures)}
    for key in ("first_token_ms", "worst_wait_ms", "longest_stall_ms"):
        out[key] = _pct([getattr(f, key) for f in figures if getattr(f, key) is not None])
    return out


def requests_summary(records: Sequence[Record]) -> dict:
    """Whole-run counts: requests, failed, broken streams, the longest pause inside any stream."""
    streams = [r for r in records if r.stream]
    gaps = [max(b - a for a, b in zip(ev, ev[1:])) for r in streams if len(ev := [r.start, *sorted(r.tokens), r.end]) > 1]
    return {"requests": len(records), "failed": sum(1 for r in records if not r.ok),
            "broken_streams": sum(1 for r in streams if not r.ok),
            "longest_stream_stall_ms": round(max(gaps, default=0.0) * 1e3, 1)}


def line(name: str, s: dict) -> str:
    """One printable line of ``summarize``'s result."""
    def fmt(key: str) -> str:
        v = s[key]
        return f"p50={v['p50']} p99={v['p99']} max={v['max']} ms"
    return (f"{name}: client-seen over {s['faults']} faults: fault -> first token to any client {fmt('first_token_ms')}; "
            f"worst in-flight client's wait for its next token {fmt('worst_wait_ms')}; "
            f"longest stall inside a stream {fmt('longest_stall_ms')}; in flight at the faults "
            f"{s['inflight_at_faults']}, of them failed {s['failed_inflight_at_faults']}"
            + (f"; {s['faults_without_progress']} faults with no client progress after" if s["faults_without_progress"] else ""))


def as_dicts(figures: Sequence[FaultFigures]) -> list[dict]:
    return [asdict(f) for f in figures]
