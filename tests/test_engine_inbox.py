"""The engine thread's inbox: typed messages, one dispatch that refuses what it does not know, and
the Sequence built by the engine from a parsed request (not by the HTTP handler)."""

from __future__ import annotations

import asyncio

import pytest

from engine import inbox
from engine.protocol import parse_request
from engine.sequence import Sequence, Status


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add(self, seq):
        self.calls.append(("add", seq.id))

    def abort(self, seq_id):
        self.calls.append(("abort", seq_id))

    def resize(self, budget, done):
        self.calls.append(("resize", budget, done))


def test_dispatch_routes_each_message_and_refuses_anything_else():
    loop = asyncio.new_event_loop()
    try:
        done = loop.create_future()
        seq = Sequence("r1", [1, 2, 3], None, 0)
        r = Recorder()
        for msg in (inbox.Add(seq), inbox.Abort("r1"), inbox.Resize(1 << 20, done)):
            inbox.dispatch(msg, r)
        assert r.calls == [("add", "r1"), ("abort", "r1"), ("resize", 1 << 20, done)]
        for bad in (("add", seq), "abort", None, inbox.Abort):  # the old string tuples among them
            with pytest.raises(TypeError, match="takes Add, Abort or Resize"):
                inbox.dispatch(bad, r)
        assert len(r.calls) == 3  # nothing was guessed at
    finally:
        loop.close()


def test_the_sequence_comes_from_the_parsed_request(tiny_model):
    from engine.protocol import ServingContext
    from engine.tokenizer import Tokenizer

    ctx = ServingContext("m", Tokenizer(tiny_model), max_len=512, vocab_size=512)
    req = parse_request({"model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "seed": 11,
                         "resume_token_ids": [9, 10]}, ctx, chat=False)
    seq = Sequence.from_request(req)
    assert (seq.id, seq.prompt_ids, seq.resume_ids, seq.status) == (req.id, [5, 6, 7], [9, 10], Status.WAITING)
    assert seq.params is req.params and seq.num_completion == 2 and seq.length == 5
    seq.resume_ids.append(1)
    assert req.resume_ids == [9, 10]  # the request is not the engine's state
