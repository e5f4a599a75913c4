"""Clients of the chaos soak besides bench/loadgen.Load's raw aiohttp ones.

``SdkClients``: the official ``openai`` SDK (AsyncOpenAI, no SDK-level retries: what the router hides
must be hidden by the router), completions and chat, streamed and not, every answer checked against
the greedy answer Load learned from an uninterrupted run. ``Quitters``: clients that walk away on
purpose (after 0..6 stream events: raw aiohttp closes the connection, the SDK closes its stream);
they are not failures, but the stack must not leak what they leave (KV slots, router in-flight
entries, connections).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp
import openai

from loadgen import PROMPTS, Load, Outcome


def _api_error(e: openai.APIError) -> str:
    status = getattr(e, "status_code", None)
    return f"openai.{type(e).__name__}" + (f" {status}" if status else "")


@dataclass
class SdkClients:
    load: Load  # the expected answers
    seed: int = 0
    max_tokens: int = 16
    outcomes: list[Outcome] = field(default_factory=list)

    async def run(self, concurrency: int, stop: asyncio.Event, timeout: float = 60.0) -> None:
        client = openai.AsyncOpenAI(base_url=self.load.base_url + "/v1", api_key="chaos", max_retries=0,
                                    timeout=timeout)
        try:
            async def worker(i: int) -> None:
                rng = random.Random(self.seed * 1000 + 500 + i)
                while not stop.is_set():
                    self.outcomes.append(await self.one(client, rng))
            await asyncio.gather(*(worker(i) for i in range(concurrency)))
        finally:
            await client.close()

    async def one(self, client: openai.AsyncOpenAI, rng: random.Random) -> Outcome:
        prompt, chat, stream = rng.choice(PROMPTS), rng.random() < 0.5, rng.random() < 0.5
        out = Outcome(start=time.monotonic(), end=0.0, ok=False, stream=stream, chat=chat)
        kw = {"model": self.load.model, "max_tokens": self.max_tokens, "temperature": 0.0}
        try:
            if chat:
                msgs = [{"role": "user", "content": prompt}]
                if stream:
                    text = await self._stream(await client.chat.completions.create(messages=msgs, stream=True, **kw),
                                              out, chat=True)
                else:
                    text = (await client.chat.completions.create(messages=msgs, **kw)).choices[0].message.content
            elif stream:
                text = await self._stream(await client.completions.create(prompt=prompt, stream=True, **kw),
                                          out, chat=False)
            else:
                text = (await client.completions.create(prompt=prompt, **kw)).choices[0].text
            if text != self.load.expected[(prompt, chat)]:
                out.error = "wrong text (repeated or missing tokens)"
            else:
                out.ok = True
        except openai.APIError as e:
            out.error = _api_error(e)
        finally:
            out.end = time.monotonic()
        return out

    async def _stream(self, stream, out: Outcome, *, chat: bool) -> str:
        parts, last = [], time.monotonic()
        try:
            async for chunk in stream:
                now = time.monotonic()
                out.max_gap, last = max(out.max_gap, now - last), now
                for choice in chunk.choices:
                    piece = choice.delta.content if chat else choice.text
                    if piece:
                        out.ttft = out.ttft or now - out.start
                        parts.append(piece)
                        if not out.tokens or out.tokens[-1] != now:
                            out.tokens.append(now)
        finally:
            await stream.close()
        return "".join(parts)


@dataclass
class Quitters:
    """Clients that disconnect mid-stream on purpose; half raw aiohttp, half the SDK."""

    base_url: str
    model: str
    seed: int = 0
    max_tokens: int = 48
    attempts: int = 0
    quit_after: dict[int, int] = field(default_factory=dict)  # events read before leaving -> count
    completed: int = 0  # the stream ended before the client meant to leave
    errors: dict[str, int] = field(default_factory=dict)  # failures before the client left

    async def run(self, concurrency: int, stop: asyncio.Event) -> None:
        sdk = openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key="chaos", max_retries=0, timeout=60.0)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                async def worker(i: int) -> None:
                    rng = random.Random(self.seed * 1000 + 900 + i)
                    while not stop.is_set():
                        await self.one(session, sdk, rng)
                        await asyncio.sleep(rng.uniform(0.0, 0.2))
                await asyncio.gather(*(worker(i) for i in range(concurrency)))
        finally:
            await sdk.close()

    async def one(self, session: aiohttp.ClientSession, sdk: openai.AsyncOpenAI, rng: random.Random) -> None:
        self.attempts += 1
        k, chat, raw, prompt = rng.randint(0, 6), rng.random() < 0.5, rng.random() < 0.5, rng.choice(PROMPTS)
        try:
            read = await (self._raw(session, k, chat, prompt) if raw else self._sdk(sdk, k, chat, prompt))
        except (aiohttp.ClientError, asyncio.TimeoutError, openai.APIError) as e:
            cause = _api_error(e) if isinstance(e, openai.APIError) else type(e).__name__
            self.errors[cause] = self.errors.get(cause, 0) + 1
            return
        if read is None:
            self.completed += 1
        else:
            self.quit_after[read] = self.quit_after.get(read, 0) + 1

    async def _raw(self, session: aiohttp.ClientSession, k: int, chat: bool, prompt: str) -> int | None:
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.0, "stream": True}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        r = await session.post(self.base_url + path, json=body)
        try:
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
            events = 0
            while events < k:
                line = await r.content.readline()
                if not line:
                    return None
                if line.startswith(b"data:"):
                    if line.strip() == b"data: [DONE]":
                        return None
                    events += 1
            return events
        finally:
            r.close()  # drops the connection: the router sees the client gone

    async def _sdk(self, sdk: openai.AsyncOpenAI, k: int, chat: bool, prompt: str) -> int | None:
        kw = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.0, "stream": True}
        if chat:
            stream = await sdk.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
        else:
            stream = await sdk.completions.create(prompt=prompt, **kw)
        try:
            if k == 0:
                return 0
            events = 0
            async for _ in stream:
                events += 1
                if events >= k:
                    return events
            return None
        finally:
            await stream.close()
