"""Stalled streams as a hang signal: is every open stream of an instance silent for longer than its
own rhythm says it should be?

Under load a frozen engine (SIGSTOP, a stuck driver) shows first in its streams: tokens that came
every few ms stop, long before probes time out. A healthy but busy engine slows its streams, it
does not stop all of them at once; and a stream that waits on *us* (a client write in progress, the
router's own loop stalled) proves nothing. So an instance is "silent" only when:

- it has at least one stream relay running, and a rhythm is known (two reads after the headers of
  one of its streams, now or recently),
- every stream relay to it is past ``max(floor, factor x its recent inter-read gap)`` since its
  last read (a stream with no rhythm of its own yet: the instance's recent gap, from its other
  streams; with none known at all: past ``2 x floor``),
- none of them is in a client write (``Attempt.armed`` False: the relay, not the engine, is slow).

The silence alone fences nothing: the health monitor (router/health.py) calls an instance hung only
when a probe sent to it also goes unanswered for ``hang_probe_timeout`` and the router's loop did not
lag meanwhile.

Contract with the stream path (router/stream.py, router/backend.py), read only, never written here:
``Instance.attempts`` holds the attempts in flight; a stream relay's ``Attempt.last`` is the
monotonic time of its last upstream read (0.0 until the relay starts, and for non-stream requests);
``Attempt.armed`` is False during a write to the client. Nothing is added to the per-read hot path:
the rhythm is sampled here every tick, so a gap shorter than a tick reads as one tick (an upper
bound, which only makes the threshold larger, never a false verdict).
"""

from __future__ import annotations

from router.backend import Instance

EWMA = 0.3  # weight of a new gap sample in a stream's recent inter-read gap


class _Track:
    __slots__ = ("attempt", "last", "reads", "gap")

    def __init__(self, attempt) -> None:
        self.attempt = attempt
        self.last = attempt.last
        self.reads = 0  # reads seen after the first sample (the first gap holds the prefill)
        self.gap: float | None = None  # recent inter-read gap, seconds


class StreamSilence:
    """Samples every stream relay of the instances it is asked about; one per health monitor."""

    def __init__(self, floor: float, factor: float) -> None:
        self.floor = floor
        self.factor = factor
        self._tracks: dict[Instance, dict[int, _Track]] = {}
        self._gap: dict[Instance, float] = {}  # the instance's recent inter-read gap, all streams

    def sample(self, inst: Instance, now: float) -> float | None:
        """Update ``inst``'s streams; return when its silence began (the latest read of any of its
        streams, monotonic) if every stream is silent as defined above, else None."""
        old = self._tracks.get(inst, {})
        tracks: dict[int, _Track] = {}
        silent, known, latest = True, False, 0.0
        for a in inst.attempts:
            if a.last == 0.0:
                continue  # not a stream relay (yet)
            t = old.get(id(a))
            if t is None or t.attempt is not a:
                t = _Track(a)
            elif a.last != t.last:
                if t.reads:
                    gap = a.last - t.last
                    t.gap = gap if t.gap is None else (1 - EWMA) * t.gap + EWMA * gap
                    g = self._gap.get(inst)
                    self._gap[inst] = gap if g is None else (1 - EWMA) * g + EWMA * gap
                t.reads += 1
                t.last = a.last
            tracks[id(a)] = t
            if not a.armed:
                silent = False  # writing to its client: a slow client, not a silent engine
                continue
            gap = t.gap if t.gap is not None else self._gap.get(inst)
            limit = 2 * self.floor if gap is None else max(self.floor, self.factor * gap)
            known = known or gap is not None
            latest = max(latest, a.last)
            if now - a.last < limit:
                silent = False
        if tracks:
            self._tracks[inst] = tracks
        else:
            self._tracks.pop(inst, None)
        return latest if silent and known else None

    def rhythm(self, inst: Instance) -> float | None:
        """``inst``'s recent inter-read gap over all its streams (seconds), or None: no stream of it
        has been seen to keep one yet, and its silence judges nothing."""
        return self._gap.get(inst)

    @property
    def tracked(self) -> dict:
        """The instances with streams sampled at the last tick."""
        return self._tracks

    def forget(self, inst: Instance) -> None:
        """Not a primary (now): drop its streams and its rhythm (a new role, a new engine)."""
        self._tracks.pop(inst, None)
        self._gap.pop(inst, None)
