"""router/cut.py: where a stream may be continued on a vLLM that leaks a prompt cut inside a
character. The events are what vLLM sends around a multi-byte character: its ids first, with no
text, then the id that completes it, with the text."""

from __future__ import annotations

from router.cut import CutPoint
from router.resume import Seen


def _seen(ids: list[int], text: str) -> Seen:
    s = Seen()
    s.choice(0, ids, text, None)
    return s


def _fed(events: list[tuple[list[int], str]]) -> tuple[CutPoint, list[int]]:
    cut, tokens = CutPoint(), []
    for ids, text in events:
        s = _seen(ids, text)
        tokens += s.ids
        cut.note(s, len(tokens))
    return cut, tokens


def test_held_back_ids_after_a_clean_event_are_taken_back_for_the_continuation():
    cut, tokens = _fed([([], ""), ([1], "a"), ([2], "b"), ([3], ""), ([4], "")])
    assert cut.rewind(tokens, asked=False) and tokens == [1, 2]
    assert cut.rewind(tokens, asked=True) and tokens == [1, 2]  # the continuation starts where the text is whole
    tokens.append(3)
    cut.note(_seen([3], ""), 3)  # generated again, still held back: taken back again
    assert cut.rewind(tokens, asked=False) and tokens == [1, 2]


def test_a_cut_right_after_a_clean_event_or_before_any_id_is_clean():
    for events in ([([1], "a"), ([2], "b")], [([], "")]):
        cut, tokens = _fed(events)
        sent = list(tokens)
        assert cut.rewind(tokens, asked=True) and tokens == sent  # nothing to take back, even ids asked for
    cut, tokens = _fed([([1], ""), ([2], "")])  # the first character not complete yet: back to the prompt
    assert not cut.rewind(tokens, asked=True)
    assert cut.rewind(tokens, asked=False) and tokens == []


def test_ids_the_client_has_are_never_taken_back():
    cut, tokens = _fed([([1], "a"), ([2], "")])
    assert not cut.rewind(tokens, asked=True) and tokens == [1, 2]  # it asked for the ids: it has them
    cut, tokens = _fed([([1], "a"), ([2, 3], "bc"), ([4], "")])  # text with several ids: maybe mid-character
    assert not cut.rewind(tokens, asked=False) and tokens == [1, 2, 3, 4]
    cut, tokens = _fed([([1], "a"), ([2, 3], "bc"), ([4], "d"), ([5], "")])  # a clean event again
    assert cut.rewind(tokens, asked=False) and tokens == [1, 2, 3, 4]
