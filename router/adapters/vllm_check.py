"""Does a vLLM instance leak its prompt into a stream continued inside a character? Asked once it is ready.

failover's vLLM plugin fixes vllm-project/vllm#48853 in every vLLM it manages
(failover_vllm/detokenizer.py). A vLLM that an operator runs behind the standalone router has the
fix only when failover is installed in that vLLM's environment. Without it, a stream that the router
continues at a cut inside a UTF-8 character (router/adapters/vllm.py) gets its prompt's text in the
middle of its completion, a chat's system prompt included.

``leaks(base, session)`` asks the instance itself, with its own tokenizer:
1. its model (``GET /v1/models``);
2. the ids of a sample (``POST /tokenize``), and the longest of their prefixes whose text ends inside
   a character (``POST /detokenize``, at most ``BACK`` ids back);
3. a few greedy tokens after that prefix (``POST /v1/completions`` with the ids as the prompt, as a
   continuation sends them). A leaking detokenizer puts the prompt's text first.

The answer is True (it leaks), False (it does not), or None (not shown: no prefix of the samples ends
inside a character with this tokenizer, or an endpoint did not answer as vLLM's do).
"""

from __future__ import annotations

import asyncio

import aiohttp
import structlog

log = structlog.get_logger(__name__)

LEAD = "failover cut check"
SAMPLES = tuple(f"{LEAD} {tail}" for tail in ("\U0001F642", "\u6f22\u5b57", "\u00e9t\u00e9"))
BACK = 4  # a UTF-8 character is at most 4 bytes: no cut inside one is further back
TIMEOUT = 30.0  # the whole check


class _Unanswered(Exception):
    pass


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise _Unanswered(f"{url}: HTTP {r.status}")
        return await r.json()


async def leaks(base: str, session: aiohttp.ClientSession) -> bool | None:
    """Whether the vLLM at ``base`` leaks a prompt that ends inside a character (module docstring)."""
    try:
        async with asyncio.timeout(TIMEOUT):
            async with session.get(base + "/v1/models") as r:
                if r.status != 200:
                    return None
                model = (await r.json())["data"][0]["id"]
            for sample in SAMPLES:
                ids = (await _post(session, base + "/tokenize",
                                   {"model": model, "prompt": sample, "add_special_tokens": False}))["tokens"]
                for back in range(1, min(BACK, len(ids) - 1) + 1):
                    cut = ids[:-back]
                    text = (await _post(session, base + "/detokenize", {"model": model, "tokens": cut}))["prompt"]
                    if text.endswith("\ufffd"):
                        out = await _post(session, base + "/v1/completions",
                                          {"model": model, "prompt": cut, "max_tokens": 4, "temperature": 0})
                        return out["choices"][0]["text"].startswith(LEAD)
            return None
    except (_Unanswered, aiohttp.ClientError, TimeoutError, KeyError, IndexError, TypeError, ValueError):
        return None


async def check(inst) -> None:
    """Ask ``inst`` (a ``router.backend.Instance`` just ready for the first time under this
    registration) and keep the answer as ``inst.cut_leak``; a leak is logged once, with its fix."""
    generation = inst.generation
    inst.cut_leak = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
        result = await leaks(inst.url, session)
    if inst.generation != generation:
        return  # re-registered meanwhile: the answer was about the process before
    inst.cut_leak = result
    if result:
        log.warning("vllm_leaks_prompt_on_cut", service=inst.service, instance=inst.name, url=inst.url,
                    hint="this vLLM lacks the fix of vllm-project/vllm#48853, so the router continues a "
                         "stream broken inside a character only from before it, and ends it with an error "
                         "where it cannot. Install failover in the environment this vLLM runs in (its "
                         "plugin carries the fix) and restart it")
    elif result is None:
        log.info("vllm_cut_check_inconclusive", service=inst.service, instance=inst.name, url=inst.url)
