"""One engine step: admit and prefill new sequences, then one batched decode step for the rest.

``LLMEngine`` is single-threaded (the engine thread owns it); ``engine.async_engine`` feeds it from
the event loop and carries its outputs back.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.detokenizer import IncrementalText
from engine.model_runner import ModelRunner, StepPlan
from engine.sampling import Draw, sample
from engine.scheduler import Scheduler, Sequence, Status
from engine.tokenizer import Tokenizer


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one sequence (text and the ids that made it; see detokenizer)."""

    seq_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    new_tokens: int  # tokens generated this step (held-back ids appear later in token_ids)


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, eos_ids: tuple[int, ...],
                 prefill_tokens: int = 4096) -> None:
        self.runner, self.tokenizer = runner, tokenizer
        self.prefill_tokens = prefill_tokens  # padded tokens per prefill forward (bounds activations)
        self.scheduler = Scheduler(runner.kv.num_slots, runner.max_len, eos_ids)
        self.texts: dict[str, IncrementalText] = {}

    @property
    def max_len(self) -> int:
        return self.runner.max_len

    def add(self, seq: Sequence) -> None:
        self.texts[seq.id] = IncrementalText(self.tokenizer.decode, seq.params.stop, list(seq.resume_ids))
        self.scheduler.add(seq)

    def abort(self, seq_id: str) -> None:
        self.scheduler.abort(seq_id)
        self.texts.pop(seq_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        outputs = []
        admitted = self.scheduler.admit()
        for group in _prefill_groups(admitted, self.prefill_tokens):
            plan = StepPlan("prefill", tuple(s.slot for s in group), tuple(tuple(s.all_ids) for s in group))
            outputs += self._advance(group, self.runner.run(plan))
        batch = self.scheduler.decode_batch(exclude=admitted)
        if batch:
            plan = StepPlan("decode", tuple(s.slot for s in batch), tuple(s.all_ids[-1] for s in batch),
                            tuple(s.length - 1 for s in batch))
            outputs += self._advance(batch, self.runner.run(plan))
        return outputs

    def _advance(self, seqs: list[Sequence], logits) -> list[RequestOutput]:
        tokens = sample(logits, [Draw(s.params, s.seed, s.length) for s in seqs])
        outputs = []
        for seq, token in zip(seqs, tokens):
            self.scheduler.append(seq, token)
            text = self.texts[seq.id]
            delta = text.add([token], final=seq.status is Status.FINISHED)
            if delta.stopped:
                self.scheduler.finish(seq, "stop")
            done = seq.status is Status.FINISHED
            if done:
                del self.texts[seq.id]
            outputs.append(RequestOutput(seq.id, delta.text, delta.token_ids, done, seq.finish_reason,
                                         len(seq.prompt_ids), seq.num_completion, 1))
        return outputs

    def grow_kv(self, budget: int, max_batch: int) -> int:
        """Grow the KV pool to what ``budget`` bytes (per rank) hold, up to ``max_batch`` slots; never
        shrinks. Runs between steps on every rank. Returns the slot count."""
        kv = self.runner.kv
        slots = min(max_batch, budget // kv.bytes_per_slot)
        if slots > kv.num_slots:
            old = kv.num_slots
            self.runner.run(StepPlan("grow", (slots,)))
            self.scheduler.add_slots(range(old, slots))
        return kv.num_slots

    def warmup(self) -> None:
        """One prefill and one decode through the whole stack (every rank), so the first request
        pays no lazy initialisation; leaves no sequence behind."""
        plan = StepPlan("prefill", (0,), ((0, 1, 2, 3),))
        self.runner.run(plan)
        self.runner.run(StepPlan("decode", (0,), (4,), (4,)))


def _prefill_groups(seqs: list[Sequence], budget: int) -> list[list[Sequence]]:
    """Split sequences (shortest first, to waste little padding) into forwards of at most ``budget``
    padded tokens; a sequence longer than the budget goes alone."""
    groups: list[list[Sequence]] = []
    for seq in sorted(seqs, key=lambda s: s.length):
        if groups and seq.length * (len(groups[-1]) + 1) <= budget:
            groups[-1].append(seq)
        else:
            groups.append([seq])
    return groups
