"""A fix to vLLM's fast incremental detokenizer for a prompt whose ids end inside a character.

vLLM primes tokenizers' ``DecodeStream`` with the whole prompt (``FastIncrementalDetokenizer``).
When the prompt's text ends in an incomplete UTF-8 character, the stream keeps no prefix, and its
first emission is the text of the whole prompt followed by the new text (vllm-project/vllm#48853,
open as of vLLM 0.32). Silent: no error, the client gets the prompt inside its completion.

failover hits it on every stream it migrates at such a point. The router continues a broken stream
with a prompt of the original prompt's ids plus every id already sent (router/adapters/vllm.py),
and vLLM sends a token's id before its text whenever the token leaves a character incomplete
(emoji, CJK on a byte-level vocabulary, any byte-fallback token). A cut there made the continuation
begin with the prompt (a chat's system prompt included) and the text already sent.

``install`` wraps the detokenizer's ``__init__``: the stream is primed with the prompt up to its
last complete character (``clean_cut``), then steps the rest, whose text it holds back as it would
have in the undisturbed stream; the first generated token that completes the character emits the
held text with its own. A prompt that ends cleanly (nearly all) costs one decode of its last
``TAIL`` ids. vLLM's ``SlowIncrementalDetokenizer`` (tokenizers without a fast backend) keeps its own
offsets and is left alone.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

log = logging.getLogger(__name__)

TAIL = 8  # ids looked back: a UTF-8 character is at most 4 bytes, a byte-fallback id at least one
_MARK = "_failover_prompt_tail_fix"


def clean_cut(decode: Callable[[list[int]], str], ids: Sequence[int]) -> int:
    """The largest ``j`` within ``TAIL`` of the end whose ``ids[:j]`` does not end inside a character
    (its text does not end in U+FFFD); ``len(ids)`` when none does, or when the whole ends cleanly."""
    n = len(ids)
    for j in range(n, max(0, n - TAIL) - 1, -1):
        if not decode(list(ids[max(0, j - TAIL):j])).endswith("\ufffd"):
            return j
    return n


def primed_stream(tokenizer, ids: Sequence[int], skip_special_tokens: bool):
    """A ``DecodeStream`` after ``ids`` that holds back the text of their incomplete last character,
    as a stream that generated them would; None when ``ids`` end cleanly (vLLM's own priming is right)."""
    from tokenizers.decoders import DecodeStream

    cut = clean_cut(lambda w: tokenizer.decode(w, skip_special_tokens=skip_special_tokens), ids)
    if cut == len(ids):
        return None
    stream = DecodeStream(ids=list(ids[:cut]), skip_special_tokens=skip_special_tokens)
    for tid in ids[cut:]:
        stream.step(tokenizer, tid)  # None: the character is not complete yet
    return stream


def install() -> bool:
    """Wrap vLLM's ``FastIncrementalDetokenizer.__init__`` (once per process). False: this vLLM has
    no such class, and nothing is changed. A detokenizer without the attributes the fix reads
    (``tokenizer``, ``skip_special_tokens``) keeps vLLM's own stream."""
    try:
        from vllm.v1.engine import detokenizer as mod
    except ImportError:
        return False
    cls = getattr(mod, "FastIncrementalDetokenizer", None)
    if cls is None:
        return False
    if getattr(cls, _MARK, False):
        return True
    original = cls.__init__

    def __init__(self, tokenizer, request, *args, **kwargs):
        original(self, tokenizer, request, *args, **kwargs)
        ids = getattr(request, "prompt_token_ids", None)
        skip = getattr(self, "skip_special_tokens", None)
        raw = getattr(self, "tokenizer", None)
        if ids and skip is not None and raw is not None:
            try:
                stream = primed_stream(raw, ids, skip)
            except Exception:  # the fix must never fail a request: vLLM's own stream stays
                log.warning("failover: priming the detokenizer failed; vLLM's own priming kept", exc_info=True)
                return
            if stream is not None:
                self.stream = stream

    __init__.__wrapped__ = original
    cls.__init__ = __init__
    setattr(cls, _MARK, True)
    log.debug("failover: vLLM's FastIncrementalDetokenizer holds back a prompt's incomplete last character")
    return True
