"""OpenAI request validation and response bodies (plus the failover extensions).

Every bad input becomes an ``ApiError`` with an OpenAI-style body and a 4xx status; nothing a client
sends reaches the engine unchecked. Extensions (ignored by the OpenAI SDK): ``token_ids`` on every
choice, ``resume_token_ids`` in the request, ``prompt`` as a list of token ids.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from engine.sampling import SamplingParams
from engine.tokenizer import TemplateError, Tokenizer

MAX_STOP = 16
ROLES = ("system", "user", "assistant", "tool", "developer")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class ServingContext:
    model_name: str
    tokenizer: Tokenizer
    max_len: int
    vocab_size: int


@dataclass(slots=True)
class GenerateRequest:
    prompt_ids: list[int]
    resume_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _field(body: dict, key: str, kinds: tuple, default=None, what: str = ""):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise _bad(key, f"'{key}' must be {what or ' or '.join(k.__name__ for k in kinds)}, "
                        f"not {type(value).__name__}")
    return value


def _token_list(value, key: str, vocab: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise _bad(key, f"'{key}' must be a list of integer token ids")
    if any(not 0 <= t < vocab for t in value):
        raise _bad(key, f"'{key}' holds a token id outside [0, {vocab})")
    return value


def _prompt_ids(body: dict, ctx: ServingContext) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = ctx.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = _token_list(prompt, "prompt", ctx.vocab_size)
    elif isinstance(prompt, list):
        raise _bad("prompt", "one prompt per request: 'prompt' must be a string or a list of token ids")
    else:
        raise _bad("prompt", "'prompt' is required: a string or a list of token ids")
    return ids


def _message_text(message, i: int) -> dict:
    if not isinstance(message, dict):
        raise _bad(f"messages.[{i}]", "each message must be an object with 'role' and 'content'")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise _bad(f"messages.[{i}].role", f"'role' must be one of {', '.join(ROLES)}")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"messages.[{i}].content", "only text content parts are supported")
            parts.append(part["text"])
        content = "".join(parts)
    elif content is None and role == "assistant":
        content = ""
    elif not isinstance(content, str):
        raise _bad(f"messages.[{i}].content", "'content' must be a string or a list of text parts")
    return {"role": role, "content": content}


def _chat_ids(body: dict, ctx: ServingContext) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty list")
    rendered = [_message_text(m, i) for i, m in enumerate(messages)]
    try:
        return ctx.tokenizer.encode_chat(rendered)
    except TemplateError as e:
        raise _bad("messages", str(e)) from e


def _sampling(body: dict, prompt_len: int, resume_len: int, ctx: ServingContext, chat: bool) -> SamplingParams:
    room = ctx.max_len - prompt_len  # completion tokens (resumed + new) that fit in the context
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _field(body, key, (int,), None, "an integer")
    if max_tokens is None:
        max_tokens = room if chat else min(16, room)
    elif max_tokens < 1:
        raise _bad(key, f"'{key}' must be at least 1")
    elif max_tokens > room:
        raise _bad(key, f"this model's maximum context length is {ctx.max_len} tokens; the prompt has "
                        f"{prompt_len} and '{key}' asks for {max_tokens} more: lower '{key}' or the prompt",
                   "context_length_exceeded")
    temperature = float(_field(body, "temperature", (int, float), 1.0, "a number"))
    if not 0 <= temperature <= 2:
        raise _bad("temperature", "'temperature' must be between 0 and 2")
    top_p = float(_field(body, "top_p", (int, float), 1.0, "a number"))
    if not 0 < top_p <= 1:
        raise _bad("top_p", "'top_p' must be in (0, 1]")
    seed = _field(body, "seed", (int,), None, "an integer")
    if seed is not None and not -(1 << 63) <= seed < (1 << 63):
        raise _bad("seed", "'seed' must fit in 64 bits")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them")
    stop_ids = _token_list(body.get("stop_token_ids") or [], "stop_token_ids", ctx.vocab_size)
    ignore_eos = _field(body, "ignore_eos", (bool,), False, "a boolean")
    return SamplingParams(temperature=temperature, top_p=top_p, seed=None if seed is None else seed & ((1 << 63) - 1),
                          max_tokens=max_tokens, stop=tuple(stop), stop_token_ids=tuple(stop_ids),
                          ignore_eos=ignore_eos)


def _unsupported(body: dict) -> None:
    n = _field(body, "n", (int,), 1, "an integer")
    if n != 1:
        raise _bad("n", "only n=1 is supported")
    if _field(body, "best_of", (int,), 1, "an integer") != 1:
        raise _bad("best_of", "only best_of=1 is supported")
    if _field(body, "echo", (bool,), False, "a boolean"):
        raise _bad("echo", "echo is not supported")
    if body.get("logprobs") not in (None, False, 0):
        raise _bad("logprobs", "logprobs are not supported")


def parse_request(body, ctx: ServingContext, *, chat: bool) -> GenerateRequest:
    if not isinstance(body, dict):
        raise _bad("", "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model", "'model' is required (a string); see /v1/models")
    if model != ctx.model_name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{ctx.model_name}'",
                       param="model", code="model_not_found")
    _unsupported(body)
    stream = _field(body, "stream", (bool,), False, "a boolean")
    options = _field(body, "stream_options", (dict,), {}, "an object")
    include_usage = _field(options, "include_usage", (bool,), False, "a boolean")
    prompt_ids = _chat_ids(body, ctx) if chat else _prompt_ids(body, ctx)
    if not prompt_ids:
        raise _bad("prompt", "the prompt is empty")
    resume = _token_list(body.get("resume_token_ids") or [], "resume_token_ids", ctx.vocab_size)
    if len(prompt_ids) >= ctx.max_len:
        raise _bad("messages" if chat else "prompt",
                   f"this model's maximum context length is {ctx.max_len} tokens; the prompt has "
                   f"{len(prompt_ids)}: shorten it", "context_length_exceeded")
    params = _sampling(body, len(prompt_ids), len(resume), ctx, chat)
    return GenerateRequest(prompt_ids, resume, params, stream, include_usage, chat)


# --- responses -------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(req: GenerateRequest, text: str, token_ids: list[int], finish_reason: str | None,
           *, chunk: bool, first: bool = False) -> dict:
    if not req.chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "token_ids": token_ids}
    if chunk:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason, "token_ids": token_ids}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason, "token_ids": token_ids}


def envelope(req: GenerateRequest, model: str, choices: list[dict], *, chunk: bool, usage_: dict | None) -> dict:
    if req.chat:
        obj, prefix = ("chat.completion.chunk" if chunk else "chat.completion"), "chatcmpl-"
    else:
        obj, prefix = "text_completion", "cmpl-"
    body = {"id": prefix + req.id, "object": obj, "created": req.created, "model": model, "choices": choices}
    if not chunk or req.include_usage:
        body["usage"] = usage_
    return body
