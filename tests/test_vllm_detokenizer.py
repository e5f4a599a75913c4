"""failover_vllm.detokenizer: a prompt that ends inside a character, as a migrated stream's does.

The router continues a vLLM stream with the prompt's ids plus every id already sent; vLLM sends a
token's id before its text when the token leaves a character incomplete. ``primed_stream`` must then
give, for every later token, exactly the text the undisturbed stream gave: the held-back character
once it completes, never the prompt. The real tokenizer (tokenizers' own ``DecodeStream``) of the
test checkpoint, byte-level BPE, so accents, CJK and emoji split across ids. The end-to-end check,
through vLLM and the router at every cut point, is tests/test_vllm_router.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from failover.tools.tiny_model import write_tokenizer
from failover_vllm.detokenizer import TAIL, clean_cut, primed_stream
from vllm_helpers import needs_vllm

TEXT = "héllo wörld 🌶 日本語, done 🙂"
PROMPT = "story: "


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, 512)
    return Tokenizer.from_file(str(d / "tokenizer.json"))


def _decode(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def test_the_clean_cut_is_the_last_complete_character(tok):
    ids = tok.encode(PROMPT + TEXT, add_special_tokens=False).ids
    decode = _decode(tok)
    split = [j for j in range(len(ids) + 1) if decode(ids[:j]).endswith("\ufffd")]
    assert split, "no prefix of the text ends inside a character: the test would test nothing"
    for j in range(len(ids) + 1):
        cut = clean_cut(decode, ids[:j])
        assert not decode(ids[:cut]).endswith("\ufffd")
        if j in split:
            assert j - TAIL <= cut < j and all(k in split for k in range(cut + 1, j + 1)), (j, cut)
        else:
            assert cut == j


def test_a_prompt_cut_anywhere_continues_with_the_undisturbed_text(tok):
    prompt = tok.encode(PROMPT, add_special_tokens=False).ids
    out = tok.encode(TEXT, add_special_tokens=False).ids
    undisturbed = DecodeStream(ids=prompt, skip_special_tokens=True)
    steps = [undisturbed.step(tok, t) or "" for t in out]
    assert "".join(steps) == TEXT
    held = [k for k in range(1, len(out)) if not steps[k - 1]]
    assert held, "no id's text was held back: the test would test nothing"
    for k in range(1, len(out)):
        ids = prompt + out[:k]
        stream = primed_stream(tok, ids, True)
        assert (stream is None) == (k not in held), k
        stream = stream or DecodeStream(ids=ids, skip_special_tokens=True)
        assert "".join(stream.step(tok, t) or "" for t in out[k:]) == "".join(steps[k:]), k


@needs_vllm
def test_the_fix_wraps_vllms_fast_detokenizer_once():
    """In a fresh interpreter, as vLLM's processes load the plugin (vLLM's import-time deprecation
    warnings are vLLM's, not ours: ignored there)."""
    code = ("from failover_vllm.detokenizer import install\n"
            "from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer as F\n"
            "original = F.__init__\n"
            "first = install(); wrapped = F.__init__; again = install()\n"
            "print(first, again, wrapped is not original, F.__init__ is wrapped, wrapped.__wrapped__ is original)")
    out = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", code], capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-5:] == ["True"] * 5, out.stdout
