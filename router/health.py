"""Active health checks: a probe of each watched instance every interval, plus confirm probes.

Probes overlap on purpose: a new one starts every ``probe_interval`` even while older ones wait
out their ``probe_timeout``, so a hung engine (SIGSTOP: the kernel still accepts connections,
nothing answers) is declared failed ``failure_threshold`` probes after it hung, about
timeout + (threshold - 1) x interval, not threshold x (timeout + interval).

A probe that timed out while the router's own loop stalled (router/looplag.py) is discounted: not
reported at all, since our lateness, not the engine's, may be what ran the clock out.

Under load a hang is seen sooner (issue 15): every tick of the loop-lag timer (router/looplag.py,
10 ms while a primary has requests in flight, 20 ms otherwise) the primary's stream relays are
sampled (router/stall.py). When every one of them is silent past its own rhythm, *and* a probe sent
to it has gone unanswered for ``hang_probe_timeout`` (shorter than ``probe_timeout``: two signals
agree; at the silence's start one probe is sent at once, not at the next ``probe_interval``), or for
twice the slowest of its latest answers where that is longer (``probe_wait``: an engine whose loop
is behind answers every probe late, and is judged by its own pace, as its streams are), *and*
no probe sent after that one got an answer, *and* the router's loop did not lag over that window,
the instance is reported once as ``HANG``. A lag vetoes the verdict until the loop has caught up:
the judgement then starts afresh (a new probe, a window after the lag). promotion.py fails it over at once, unless it is the
last ready instance (then it is kept, as for a probe timeout).

The monitor only observes; it reports each verdict to ``on_result`` (the router decides).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable

import structlog

from failover_common.tasks import Tasks

from router import states
from router.backend import Instance
from router.config import RouterConfig
from router.looplag import LoopLag
from router.stall import StreamSilence
from router.upstream import Pool, PoolClosed, ProtocolError

log = structlog.get_logger(__name__)

# The ``why`` of a probe that timed out: slow, perhaps hung, not known dead (promotion.py treats it
# apart: the last ready instance is never fenced for it).
PROBE_TIMEOUT = "timeout"
# The ``why`` of a hang verdict: every stream silent and a probe unanswered (see the module doc).
HANG = "hang: streams silent and probe unanswered"

# A probe unanswered for longer than this many times the slowest of the instance's ANSWERS_KEPT
# latest answers backs a hang verdict (probe_wait).
ANSWER_FACTOR = 2.0
ANSWERS_KEPT = 8

# on_result(instance, generation, ok, why, latency_s)
ResultFn = Callable[[Instance, int, bool, str, float], None]


class HealthMonitor:
    def __init__(self, config: RouterConfig, on_result: ResultFn, lag: LoopLag,
                 on_discount: Callable[[Instance, float], None] | None = None) -> None:
        self.config = config
        self.on_result = on_result
        self.lag = lag
        self.on_discount = on_discount
        self._loops: dict[Instance, asyncio.Task] = {}
        self._probes = Tasks()
        self._pending: dict[Instance, int] = {}
        self._pools: dict[str, Pool] = {}  # per instance URL: the probes' own keep-alive connections
        self._max_pending = math.ceil(config.probe_timeout / config.probe_interval) + 1
        self._sent: dict[Instance, dict[int, float]] = {}  # probes awaiting an answer: serial -> start
        self._answered: dict[Instance, float] = {}  # send time of the latest probe that got any HTTP answer
        self._answer_s: dict[Instance, deque[float]] = {}  # how long its latest probes took to be answered
        self._serial = 0
        self._silence = StreamSilence(config.hang_stream_floor, config.hang_stream_factor)
        self._reported: dict[Instance, float] = {}  # silence start already reported as HANG
        self._asked: dict[Instance, tuple[float, float]] = {}  # (silence start, veto) a probe was sent for
        # when our loop's lag last vetoed a hang verdict: the verdict is judged afresh from then on
        self._vetoed: dict[Instance, float] = {}

    def watch(self, inst: Instance) -> None:
        """(Re)start probing ``inst``; the loop ends by itself when the role is not watched.

        A loop of an older registration is replaced, not kept: it would end at its next wake-up on
        the generation change and leave the new registration unprobed.
        """
        task = self._loops.get(inst)
        if task is not None and not task.done():
            task.cancel()
        self._loops[inst] = asyncio.get_running_loop().create_task(
            self._loop(inst), name=f"probe-loop-{inst.name}")
        if self.config.hang_probe_timeout > 0:
            self.lag.on_tick = self._stall_tick  # the sampler rides on the loop-lag timer: no task of its own

    def stream_rhythm(self, inst: Instance) -> float | None:
        """The inter-read gap the stall sampler has learned for ``inst``'s streams (None: none yet;
        a hang is then seen by the probes alone)."""
        return self._silence.rhythm(inst)

    def confirm(self, inst: Instance) -> None:
        """Probe now (a proxied request just failed on ``inst``)."""
        self._spawn(inst)

    async def stop(self) -> None:
        if self.lag.on_tick == self._stall_tick:
            self.lag.on_tick = None
        loops = list(self._loops.values())
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, self._probes.stop(), return_exceptions=True)
        self._loops.clear()
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.close()

    async def _loop(self, inst: Instance) -> None:
        generation = inst.generation
        try:
            while inst.generation == generation and inst.role in states.WATCHED and not inst.fenced:
                if self._pending.get(inst, 0) < self._max_pending:
                    self._spawn(inst)
                await asyncio.sleep(self.config.probe_interval)
        finally:
            if self._loops.get(inst) is asyncio.current_task():
                del self._loops[inst]
                self._unused(inst.url)

    def _spawn(self, inst: Instance) -> None:
        self._pending[inst] = self._pending.get(inst, 0) + 1
        self._serial += 1
        self._probes.spawn(self._probe(inst, self._serial), f"probe-{inst.name}")

    async def _probe(self, inst: Instance, serial: int) -> None:
        generation = inst.generation
        t0 = time.monotonic()
        self._sent.setdefault(inst, {})[serial] = t0
        ok, why = False, ""
        try:
            async with asyncio.timeout(self.config.probe_timeout):
                async with self._pool(inst).request("GET", inst.probe_path, b"", None) as resp:
                    # its HTTP side lived after t0, whatever it says
                    self._answered[inst] = max(self._answered.get(inst, 0.0), t0)
                    self._answer_s.setdefault(inst, deque(maxlen=ANSWERS_KEPT)).append(time.monotonic() - t0)
                    await resp.read()
                    ok, why = resp.status == 200, f"status {resp.status}"
        except TimeoutError:
            why = PROBE_TIMEOUT
        except (OSError, ProtocolError, PoolClosed) as exc:  # router/upstream_errors.py's
            why = f"{type(exc).__name__}: {exc}"
        finally:
            self._pending[inst] -= 1
            if not self._pending[inst]:
                del self._pending[inst]
            sent = self._sent.get(inst)
            if sent is not None:
                sent.pop(serial, None)
                if not sent:
                    del self._sent[inst]
            self._unused(inst.url)
        if why == PROBE_TIMEOUT and (lag := self.lag.lag_since(t0)) > self.config.loop_lag_tolerance:
            log.warning("probe_discounted", service=inst.service, instance=inst.name,
                        loop_lag_ms=round(lag * 1e3, 1), tolerance_ms=round(self.config.loop_lag_tolerance * 1e3, 1))
            if self.on_discount is not None:
                self.on_discount(inst, lag)
            return
        self.on_result(inst, generation, ok, why, time.monotonic() - t0)

    def _stall_tick(self, now: float) -> bool:
        """One sample of the primaries' streams (the loop-lag timer's ``on_tick``); True while a
        primary has requests in flight (the next tick comes at the fast rhythm)."""
        busy = False
        for inst in list(self._loops):
            if inst.role == states.PRIMARY and inst.ready and not inst.fenced:
                if inst.attempts:
                    busy = True
                    self._check_hang(inst, now)
                elif inst in self._silence.tracked:
                    self._check_hang(inst, now)  # its last streams just ended: let the sampler forget them
            else:
                self._silence.forget(inst)
        return busy

    def _check_hang(self, inst: Instance, now: float) -> None:
        silent = self._silence.sample(inst, now)
        if silent is None or self._reported.get(inst) == silent:
            return
        # The oldest probe still waiting that was sent after the last one to get an answer: an
        # answer to a later probe would show its HTTP side alive (busy, or only its decode stalled).
        # A veto (below) restarts the judgement: only probes sent after it count, and only lag after it.
        vetoed = self._vetoed.get(inst, 0.0)
        answered = max(self._answered.get(inst, 0.0), vetoed)
        probe_t0 = min((t for t in self._sent.get(inst, {}).values() if t > answered), default=None)
        if probe_t0 is None or now - probe_t0 < self.probe_wait(inst):
            if self._asked.get(inst) != (silent, vetoed):  # ask now rather than at the next probe_interval
                self._asked[inst] = (silent, vetoed)
                self._spawn(inst)
            return  # the streams alone fence nothing: wait for a probe to agree (or not)
        if (lag := self.lag.lag_since(max(min(silent, probe_t0), vetoed))) > self.config.loop_lag_tolerance:
            # our loop was late: the tokens may be sitting unread in our sockets. Not for good: once
            # the loop has caught up, streams still silent and a fresh probe unanswered are a hang
            # (a lag kept in the window would veto every later verdict, leaving only the probes)
            self._vetoed[inst] = now
            return
        self._reported[inst] = silent
        log.warning("hang_detected", service=inst.service, instance=inst.name,
                    streams=sum(1 for a in inst.attempts if a.last), silent_ms=round((now - silent) * 1e3, 1),
                    probe_unanswered_ms=round((now - probe_t0) * 1e3, 1),
                    probe_wait_ms=round(self.probe_wait(inst) * 1e3, 1), loop_lag_ms=round(lag * 1e3, 1))
        self.on_result(inst, inst.generation, False, HANG, now - probe_t0)

    def probe_wait(self, inst: Instance) -> float:
        """How long a probe of ``inst`` must go unanswered to back a hang verdict: ``hang_probe_timeout``,
        or ``ANSWER_FACTOR`` x the slowest of its latest answers where that is longer (at most
        ``probe_timeout``). An engine whose loop is behind (a GPU engine under overload answered in
        240-500 ms) is judged by its own pace, as its streams are by their rhythm."""
        answers = self._answer_s.get(inst)
        slowest = max(answers) if answers else 0.0
        return max(self.config.hang_probe_timeout, min(self.config.probe_timeout, ANSWER_FACTOR * slowest))

    def _pool(self, inst: Instance) -> Pool:
        """The probes' connections to ``inst``: never a proxied request's pool (a busy one must not
        delay them), and no cap (probes overlap on a hung engine). router/upstream.py's client costs
        a probe ~35 us of CPU where aiohttp's cost ~80 (issue 20: the router's background work)."""
        pool = self._pools.get(inst.url)
        if pool is None or pool.closed:
            pool = self._pools[inst.url] = Pool(inst.url, 1 << 30, self.config.probe_timeout)
        return pool

    def _unused(self, url: str) -> None:
        """Close the probes' connections to ``url`` once no loop watches it and no probe waits on it
        (an instance relaunched on a new port must not leave its old pool open)."""
        if url in self._pools and not any(i.url == url for i in (*self._loops, *self._pending)):
            self._pools.pop(url).close_now()
