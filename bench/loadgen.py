"""Closed-loop load for the proof benchmarks: completions and chat, streamed and not.

Every answer is checked against the greedy answer of an uninterrupted run, so a stream that was
migrated with a repeated or missing token counts as broken even though it ended with [DONE].
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp

from client_figures import fault_figures, percentile, requests_summary, summarize

__all__ = ["CALM_S", "PROMPTS", "Load", "Outcome", "closed_loop", "percentile", "summary", "tail"]

PROMPTS = [
    "The quick brown fox", "A hot standby takes over", "Weights stay resident", "Hello, world!",
    "one two three four", "def main():", "Failover in well under", "The primary engine fails",
]


@dataclass(slots=True)
class Outcome:
    start: float
    end: float
    ok: bool
    stream: bool
    chat: bool
    error: str = ""
    ttft: float | None = None
    max_gap: float = 0.0  # longest pause between two chunks of a stream
    tokens: list[float] = field(default_factory=list)  # when each token-carrying event arrived (streams)
    instance: str = ""  # X-Failover-Instance: who answered (a migrated stream: who started it)


@dataclass(slots=True)
class Load:
    base_url: str
    max_tokens: int = 16
    stream_ratio: float = 0.5
    chat_ratio: float = 0.3
    seed: int = 0
    model: str = ""  # learned from /v1/models
    expected: dict = field(default_factory=dict)  # (prompt, chat) -> greedy text
    outcomes: list[Outcome] = field(default_factory=list)

    def body(self, prompt: str, chat: bool, stream: bool) -> tuple[str, dict]:
        b = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.0, "stream": stream}
        if chat:
            return "/v1/chat/completions", b | {"messages": [{"role": "user", "content": prompt}]}
        return "/v1/completions", b | {"prompt": prompt}

    async def learn_expected(self, session: aiohttp.ClientSession) -> None:
        """The model name and reference answers, taken once from a healthy backend before any fault."""
        async with session.get(self.base_url + "/v1/models") as r:
            r.raise_for_status()
            self.model = (await r.json())["data"][0]["id"]
        for prompt in PROMPTS:
            for chat in (False, True):
                path, body = self.body(prompt, chat, stream=False)
                async with session.post(self.base_url + path, json=body) as r:
                    r.raise_for_status()
                    data = await r.json()
                choice = data["choices"][0]
                self.expected[(prompt, chat)] = choice["message"]["content"] if chat else choice["text"]

    async def one(self, session: aiohttp.ClientSession, rng: random.Random) -> Outcome:
        prompt, chat, stream = rng.choice(PROMPTS), rng.random() < self.chat_ratio, rng.random() < self.stream_ratio
        path, body = self.body(prompt, chat, stream)
        out = Outcome(start=time.monotonic(), end=0.0, ok=False, stream=stream, chat=chat)
        try:
            async with session.post(self.base_url + path, json=body) as r:
                out.instance = r.headers.get("X-Failover-Instance", "")
                if r.status != 200:
                    out.error = f"http {r.status}"
                    return out
                text = await (self._read_stream(r, chat, out) if stream else self._read_json(r, chat))
            if text is None:
                out.error = "stream ended without [DONE]"
            elif text != self.expected[(prompt, chat)]:
                out.error = "wrong text (repeated or missing tokens)"
            else:
                out.ok = True
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, KeyError) as e:
            out.error = type(e).__name__
        finally:
            out.end = time.monotonic()
        return out

    async def _read_json(self, r: aiohttp.ClientResponse, chat: bool) -> str:
        choice = (await r.json())["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]

    async def _read_stream(self, r: aiohttp.ClientResponse, chat: bool, out: Outcome) -> str | None:
        parts, last = [], time.monotonic()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            now = time.monotonic()
            out.max_gap, last = max(out.max_gap, now - last), now
            data = line[5:].strip()
            if data == "[DONE]":
                return "".join(parts)
            for choice in json.loads(data).get("choices", []):
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                # a token arrived even when its text is empty: a random-weight model's ids past the
                # tokenizer's vocabulary decode to nothing, and the client-seen figures must still see it
                if piece is not None and choice.get("finish_reason") is None or piece:
                    out.ttft = out.ttft or now - out.start
                    if not out.tokens or out.tokens[-1] != now:
                        out.tokens.append(now)
                if piece:
                    parts.append(piece)
        return None

    async def run(self, concurrency: int, stop: asyncio.Event, timeout: float = 60.0) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async def worker(i: int) -> None:
                rng = random.Random(self.seed * 1000 + i)
                while not stop.is_set():
                    self.outcomes.append(await self.one(session, rng))
            await asyncio.gather(*(worker(i) for i in range(concurrency)))


CALM_S = 2.0  # after a fault: the failover, the migrated streams' re-prefill, the replacement's start


def near_fault(o: Outcome, faults: list[float]) -> bool:
    """Whether ``o`` overlapped the CALM_S after a fault."""
    return any(o.end > f and o.start < f + CALM_S for f in faults)


def summary(outcomes: list[Outcome], faults: list[float], elapsed: float) -> dict:
    """Whole-run counts and latency, and the client-seen figures around each fault (client_figures)."""
    failed = [o for o in outcomes if not o.ok]
    causes: dict[str, int] = {}
    for o in failed:
        causes[o.error] = causes.get(o.error, 0) + 1
    lat = [o.end - o.start for o in outcomes if o.ok]
    # the same, less every request that overlaps [fault, fault + CALM_S]: how much of the tail the faults are
    calm = [o.end - o.start for o in outcomes if o.ok and not near_fault(o, faults)]
    figures = summarize(fault_figures(outcomes, faults))
    return requests_summary(outcomes) | {
        "failed_by_cause": causes, "tail": tail(outcomes, faults),
        "rps": round(len(outcomes) / elapsed, 1) if elapsed else 0.0,
        "latency_p50_ms": round(percentile(lat, 50) * 1e3, 1), "latency_p99_ms": round(percentile(lat, 99) * 1e3, 1),
        "latency_p99_calm_ms": round(percentile(calm, 99) * 1e3, 1) if calm else None,
        "blackout_p50_ms": figures["first_token_ms"]["p50"], "blackout_p99_ms": figures["first_token_ms"]["p99"],
        "client": figures, "mean_latency_ms": round(statistics.fmean(lat) * 1e3, 1) if lat else None,
    }


def tail(outcomes: list[Outcome], faults: list[float]) -> dict:
    """Who the slowest 1 % of the answered requests were: how many overlapped the CALM_S after a
    fault, how many were streams, and the slowest one's place (ms after the last fault it began
    after, None: before the first), so a p99 read off one run says what made it."""
    ok = sorted((o for o in outcomes if o.ok), key=lambda o: o.end - o.start, reverse=True)
    if not ok:
        return {}
    slow = ok[:max(1, len(ok) // 100)]

    def after_fault(o: Outcome) -> float | None:
        before = [f for f in faults if f <= o.start]
        return round((o.start - before[-1]) * 1e3, 1) if before else None

    worst = slow[0]
    return {
        "n": len(slow), "from_ms": round((slow[-1].end - slow[-1].start) * 1e3, 1),
        "near_fault": sum(near_fault(o, faults) for o in slow),
        "streams": sum(o.stream for o in slow),
        "worst": {"ms": round((worst.end - worst.start) * 1e3, 1), "began_after_fault_ms": after_fault(worst),
                  "stream": worst.stream, "instance": worst.instance},
    }


async def closed_loop(url: str, concurrency: int, seconds: float) -> float:
    """GET ``url`` from ``concurrency`` clients back to back for ``seconds``: answers per second."""
    done = 0
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                async with s.get(url) as r:
                    await r.read()
                done += 1
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / seconds
