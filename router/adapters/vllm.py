"""Exact stream migration on vLLM's OpenAI server (``engine = "vllm"``).

vLLM sends token ids only when asked (``return_token_ids: true``): then every choice of a streamed
chunk carries ``token_ids``, and the first chunk the prompt's ids (``choices[0].prompt_token_ids``
on /v1/completions; ``prompt_token_ids`` on the chunk on /v1/chat/completions, where they carry the
chat template). One ``VllmStream`` per streamed request (a ``router.resume.Resume``):

- ``first_body`` adds ``return_token_ids`` when the client did not ask for it, and ``client_event``
  then takes ``token_ids``/``prompt_token_ids`` out of every event again, so the client gets what it
  asked for and nothing more;
- ``resume_body`` continues a broken stream with a plain /v1/completions request (``resume_path``)
  whose prompt is the prompt's ids plus every id already sent, ``max_tokens`` (and ``min_tokens``)
  reduced by those, and the same sampling parameters and seed. vLLM's detokenizer starts from the
  prompt ids, so the continuation's text joins the text already sent;
- ``continuation`` rewrites the continuation's events for the client: the first segment's ``id`` and
  ``created``, chat chunks rebuilt from completion chunks (``delta.content``), usage counted against
  the original prompt (prompt tokens = the original's, completion tokens include those sent before).

What cannot be continued exactly is refused up front (``why_not``), and such a stream gets an
in-band error event if its upstream breaks after its first byte, never a replay: n > 1, best_of,
echo, beam search, stop strings (vLLM holds back text that might begin one, while its ids are sent,
so the held text would be lost), tools, structured output, chat logprobs, multimodal content, prompt
lists, and any parameter this module does not know. A chat chunk with anything other than ``content``
in its delta (a reasoning or tool parser on the server) makes the stream non-migratable then.

Greedy streams continue token for token as the undisturbed run would; a seeded sampled stream
continues deterministically (same seed), but vLLM seeds a generator per request, so its remainder is
not the one the undisturbed run would have drawn. Either way no token is repeated or skipped.
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.adapters.vllm_check import check as check_instance
from router.errors import BackendFailed
from router.resume import Seen

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Sampling and output parameters a continuation keeps as they are (both endpoints).
CARRY = frozenset({
    "model", "stream", "stream_options", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
    "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids", "ignore_eos",
    "logit_bias", "allowed_token_ids", "bad_words", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "user", "priority", "length_penalty", "vllm_xargs", "cache_salt",
    "logprobs"})
# Known, and fine once the prompt is ids (the ids carry them), or checked below: not carried over.
TEMPLATE = frozenset({"prompt", "messages", "max_completion_tokens", "add_generation_prompt",
                      "continue_final_message", "chat_template", "chat_template_kwargs", "documents",
                      "add_special_tokens", "return_token_ids", "n", "best_of", "echo", "stop",
                      "request_id", "top_logprobs", "tool_choice", "parallel_tool_calls"})


def why_not(payload: dict, path: str) -> str | None:
    """Why a stream of ``payload`` to ``path`` cannot be continued exactly (None: it can)."""
    if path not in (COMPLETIONS, CHAT):
        return f"{path} is not a completion endpoint"
    unknown = sorted(k for k in payload if k not in CARRY and k not in TEMPLATE)
    if unknown:
        return f"parameters a continuation cannot be shown to keep: {', '.join(unknown)}"
    if payload.get("n") not in (None, 1) or payload.get("best_of") not in (None, 1):
        return "n or best_of > 1"
    if payload.get("echo"):
        return "echo"
    if payload.get("stop"):
        return "stop strings (vLLM holds back text that may start one; that text would be lost)"
    if path == COMPLETIONS:
        prompt = payload.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
            return "a prompt list (several prompts)"
        if payload.get("logprobs") not in (None, 0, False) and not isinstance(payload.get("logprobs"), int):
            return "logprobs"
        return None
    if payload.get("logprobs") or payload.get("top_logprobs"):
        return "chat logprobs"
    if payload.get("tool_choice") not in (None, "none"):
        return "tool calls"
    for m in payload.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(not (isinstance(p, dict) and p.get("type") == "text") for p in content):
            return "multimodal content"
    return None


class VllmStream:
    """One streamed request to a vLLM service: its migration state (see the module docstring)."""

    def __init__(self, payload: dict, path: str) -> None:
        self.payload, self.path = payload, path
        self.chat = path == CHAT
        self.asked = payload.get("return_token_ids") is True
        self.why_not = why_not(payload, path)
        self.prompt_ids: list[int] | None = None
        self.resumed_after = 0  # ids sent before the current continuation
        self._last: tuple[bytes, dict] | None = None  # the event inspect() decoded last

    @property
    def resumable(self) -> bool:
        return self.why_not is None

    def first_body(self, payload: dict | None, raw: bytes | bytearray) -> bytes | bytearray:
        if self.asked or not self.resumable:
            return raw  # asked already, or no point: the client's bytes go through as they are
        return _encode({**self.payload, "return_token_ids": True})

    @property
    def rewrites_first(self) -> bool:
        """The client did not ask for ids: first-segment events are rewritten without them."""
        return not self.asked and self.resumable

    def resume_path(self, path: str) -> str:
        return COMPLETIONS

    def resume_body(self, payload: dict, sent: list[int]) -> bytes | None:
        """The continuation after ``sent`` (every id the client got); None: no prompt ids seen."""
        if self.prompt_ids is None or not self.resumable:
            return None
        p = self.payload
        body: dict[str, Any] = {k: v for k, v in p.items() if k in CARRY}
        budget = p.get("max_completion_tokens") if self.chat else None
        budget = budget if budget is not None else p.get("max_tokens")
        if budget is not None:
            body["max_tokens"] = max(1, budget - len(sent))
        if p.get("min_tokens"):
            body["min_tokens"] = max(0, p["min_tokens"] - len(sent))
        if self.chat:
            body.pop("logprobs", None)  # chat's is a bool (refused when true); completions' an int
            if "skip_special_tokens" not in p:
                body["skip_special_tokens"] = True
        body.update(prompt=self.prompt_ids + sent, stream=True, return_token_ids=True)
        self.resumed_after = len(sent)
        return _encode(body)

    # -- events ----------------------------------------------------------------------------------
    def _obj(self, data: bytes, instance: str) -> dict:
        if self._last is not None and self._last[0] is data:
            return self._last[1]
        try:
            obj = _decode(data)
        except msgspec.DecodeError as exc:
            raise BackendFailed(instance, "garbage", f"undecodable SSE data: {data[:80]!r}") from exc
        if not isinstance(obj, dict):
            raise BackendFailed(instance, "garbage", f"SSE data is not an object: {data[:80]!r}")
        self._last = (data, obj)
        return obj

    def inspect(self, data: bytes, instance: str) -> Seen:
        obj = self._obj(data, instance)
        seen = Seen()
        choices = obj.get("choices")
        if self.prompt_ids is None:
            ids = obj.get("prompt_token_ids")
            if ids is None and isinstance(choices, list) and choices and isinstance(choices[0], dict):
                ids = choices[0].get("prompt_token_ids")
            if isinstance(ids, list):
                self.prompt_ids = ids
        if not isinstance(choices, list):
            if "error" not in obj and obj.get("usage") is None:
                raise BackendFailed(instance, "garbage", "SSE chunk without choices")
            return seen
        seen.migratable = self.resumable and self.prompt_ids is not None  # no prompt ids: no continuation
        for ch in choices:
            if not isinstance(ch, dict):
                raise BackendFailed(instance, "garbage", "SSE choice is not an object")
            text, delta = ch.get("text"), ch.get("delta")
            if isinstance(delta, dict):
                text = delta.get("content")
                if any(k not in ("role", "content") for k in delta):
                    seen.migratable = False  # reasoning or tool-call deltas: not rebuilt from completions
            seen.choice(ch.get("index", 0), ch.get("token_ids"), text, ch.get("finish_reason"))
        return seen

    def head(self, data: bytes, instance: str = "-") -> tuple[Any, Any]:
        """The first event's ``id`` and ``created``, stamped on a continuation's events."""
        obj = self._obj(data, instance)
        return obj.get("id"), obj.get("created")

    def client_event(self, data: bytes, instance: str) -> bytes:
        """A first-segment event as the client asked for it: the ids it did not ask for set to null,
        as vLLM itself sends them unasked."""
        if self.asked or not self.resumable:
            return data
        obj = self._obj(data, instance)
        if "prompt_token_ids" in obj:
            obj["prompt_token_ids"] = None
        for ch in obj.get("choices") or ():
            for key in ("token_ids", "prompt_token_ids"):
                if isinstance(ch, dict) and key in ch:
                    ch[key] = None
        return _encode(obj)

    def continuation(self, data: bytes, first_id: Any, created: Any, instance: str) -> bytes | None:
        """A continuation event (a completion chunk) rewritten as the first segment's stream (None:
        nothing for the client in it)."""
        obj = self._obj(data, instance)
        if not self.inspect(data, instance).carried and obj.get("usage") is None and "error" not in obj:
            return None
        choices = []
        for ch in obj.get("choices") or ():
            if self.chat:
                out = {"index": ch.get("index", 0), "delta": {"content": ch.get("text") or ""},
                       "logprobs": None, "finish_reason": ch.get("finish_reason")}
                if "stop_reason" in ch:
                    out["stop_reason"] = ch["stop_reason"]
            else:  # the extended prompt is not the client's: it got the original in the first segment
                out = {**ch, "prompt_token_ids": None}
            out["token_ids"] = ch.get("token_ids") if self.asked else None
            choices.append(out)
        event: dict[str, Any] = {"id": first_id if first_id is not None else obj.get("id"),
                                 "object": "chat.completion.chunk" if self.chat else obj.get("object", "text_completion"),
                                 "created": created if created is not None else obj.get("created"),
                                 "model": obj.get("model"), "choices": choices}
        usage = obj.get("usage")
        if isinstance(usage, dict) and self.prompt_ids is not None:
            done = (usage.get("completion_tokens") or 0) + self.resumed_after
            usage = {**usage, "prompt_tokens": len(self.prompt_ids), "completion_tokens": done,
                     "total_tokens": len(self.prompt_ids) + done}
        if usage is not None:
            event["usage"] = usage
        for key in ("system_fingerprint", "error"):
            if key in obj:
                event[key] = obj[key]
        return _encode(event)


class VllmAdapter:
    """The vLLM engine kind, for the router: its probe path and one ``VllmStream`` per stream."""

    name = "vllm"
    probe_path = "/health"
    check = staticmethod(check_instance)  # once an instance is first ready: does it leak a cut prompt?

    def stream(self, payload: dict, path: str) -> VllmStream:
        return VllmStream(payload, path)
