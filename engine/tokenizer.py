"""Text <-> ids with the checkpoint's ``tokenizer.json``; chat prompts from its chat template.

The chat template (``tokenizer_config.json``) is rendered with jinja2 in a sandbox, as transformers
does; a model without one gets a plain ``role: content`` fallback.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment  # imported here: a zygote pays for it once
from tokenizers import Tokenizer as HFTokenizer

PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class TemplateError(ValueError):
    """The chat template refused the messages (its own raise_exception, or a rendering error)."""


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        self._tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        try:
            cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            cfg = {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.has_chat_template = bool(template)
        self._template = _compile(template or PLAIN_TEMPLATE)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        tid = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        return () if tid is None else (tid,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict]) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=True,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError:
            raise
        except Exception as e:  # jinja2 raises many types; all mean "these messages do not render"
            raise TemplateError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # the template writes any BOS itself, so the tokenizer must not add another
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _compile(source: str):
    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
