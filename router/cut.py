"""Where a stream may be continued on a vLLM that leaks a prompt cut inside a character.

Such a vLLM (router/adapters/vllm_check.py finds it) answers a continuation whose prompt ends inside
a UTF-8 character with the prompt's text first (vllm-project/vllm#48853). The relay keeps one
``CutPoint`` per stream, fed every event the client got (``note``):

- a detokenizer emits text only when its window ends outside a character, so after an event that
  brought exactly one id and its text the ids sent so far end cleanly (``Seen.clean``);
- ids sent after that in events with no text are held back (their character is not complete yet):
  the client has none of their text, so a continuation may start before them and generate them
  again (``rewind``), unless the client asked for the ids themselves;
- an event that brought text with several ids may end inside a character, and the client has its
  text: no continuation may start before it, and none after it is known clean until the next
  clean event.
"""

from __future__ import annotations

from router.resume import Seen


class CutPoint:
    __slots__ = ("clean_at",)

    def __init__(self) -> None:
        self.clean_at: int | None = 0  # ids sent up to the last clean point (None: text shown past it)

    def note(self, s: Seen, total: int) -> None:
        """One event the client got; ``total``: the ids sent, its own included."""
        if s.ids:
            if s.clean:
                self.clean_at = total
            elif s.shown:
                self.clean_at = None

    def rewind(self, tokens: list[int], asked: bool) -> bool:
        """Make ``tokens`` (the relay's record of the ids sent) end at the last clean point, so a
        continuation starts where the client's text is whole: True if they end there already, or once
        the held-back ids after it are taken out (generated again). False, and nothing changed: text
        was shown past that point, or the client asked for the ids and has them."""
        at = self.clean_at
        if at == len(tokens):
            return True
        if at is None or asked:
            return False
        del tokens[at:]
        return True
