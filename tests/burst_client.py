"""A burst of concurrent requests from its own process (so the router's loop is not also the
clients'): ``python burst_client.py URL COUNT MAX_TOKENS``. Prints one JSON line: how many answers
of each status, how many 503s lacked Retry-After, and the first few transport errors."""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp


async def one(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int, out: dict) -> None:
    body = {"model": "tiny", "prompt": f"burst {i}", "max_tokens": max_tokens, "temperature": 0,
            "stream": i % 2 == 0}
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            data = await r.read()
            key = str(r.status)
            if r.status == 200 and body["stream"] and not data.rstrip().endswith(b"data: [DONE]"):
                key = "200 without [DONE]"
            out["statuses"][key] = out["statuses"].get(key, 0) + 1
            if r.status == 503 and "Retry-After" not in r.headers:
                out["no_retry_after"] += 1
            if r.status not in (200, 503) and len(out["bodies"]) < 5:
                out["bodies"].append(data[:300].decode(errors="replace"))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out["statuses"]["error"] = out["statuses"].get("error", 0) + 1
        if len(out["errors"]) < 5:
            out["errors"].append(repr(exc))


async def main(url: str, count: int, max_tokens: int) -> None:
    out = {"statuses": {}, "no_retry_after": 0, "errors": [], "bodies": []}
    # limit=0: every request its own connection at once, as the red-team burst did
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(one(session, url, i, max_tokens, out) for i in range(count)))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
