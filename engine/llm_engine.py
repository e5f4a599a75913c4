"""One engine step: schedule (blocks for the running, then admission), prefill the admitted
sequences, one batched decode step for the rest.

``LLMEngine`` is single-threaded (the engine thread owns it); ``engine.async_engine`` feeds it from
the event loop and carries its outputs back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import structlog

from engine.block_manager import BlockManager
from engine.detokenizer import IncrementalText
from engine.model_runner import ModelRunner, StepPlan
from engine.sampling import Draw, SamplingParams, sample
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status
from engine.tokenizer import Tokenizer

log = structlog.get_logger(__name__)
SLOW_STEP_S = 0.04  # a step longer than this is logged with what it held
IDLE_S = 1.0  # and so are the first steps after an idle time this long (a promoted standby's first)


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


@dataclass(frozen=True, slots=True)
class KVUsage:
    """The pool as the scheduler sees it (per rank): what ``/ready``, ``/admin/kv`` and ``/metrics``
    report."""

    bytes: int
    blocks_total: int
    blocks_used: int
    block_size: int
    preemptions: int

    def fields(self) -> dict:
        return {"kv_bytes": self.bytes, "kv_blocks_total": self.blocks_total, "kv_blocks_used": self.blocks_used,
                "kv_block_size": self.block_size, "kv_preemptions": self.preemptions}


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, eos_ids: tuple[int, ...],
                 prefill_tokens: int = 4096, prefill_chunk: int | None = None) -> None:
        self.runner, self.tokenizer = runner, tokenizer
        self.prefill_tokens = prefill_tokens  # padded tokens per prefill forward (bounds activations)
        # prompt tokens prefilled per step while other sequences decode (0: whole prompts at once)
        self.prefill_chunk = runner.cfg.prefill_chunk if prefill_chunk is None else prefill_chunk
        kv = runner.kv
        # runways (consecutive blocks per sequence) serve the CPU's copy-free decode; CUDA reads
        # blocks in place and keeps plain lowest-first allocation
        self.scheduler = Scheduler(BlockManager(kv.num_blocks, kv.block_size, runways=not kv.fused),
                                   runner.cfg.max_batch, runner.max_len, eos_ids)
        self.texts: dict[str, IncrementalText] = {}
        self._last_step_end, self._log_steps = time.perf_counter(), 0
        self._blocked = False  # the last step found every sequence waiting for a bigger pool
        self.row_steps = 0  # steps that prefilled as one forward of one token per row (CUDA step graphs)

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

    def blocked(self) -> bool:
        """Sequences wait and none runs: the first needs more blocks than the whole pool holds (a
        standby's pool below one full context, before its growth). Logged once per such wait."""
        stuck = not self.scheduler.running and bool(self.scheduler.waiting)
        if stuck and not self._blocked:
            head = self.scheduler.waiting[0]
            log.warning("kv_pool_too_small", seq=head.id, tokens=head.length,
                        blocks_needed=self.scheduler.blocks.blocks_for(head.length),
                        pool_blocks=self.scheduler.blocks.num_blocks,
                        why="waits until the pool grows (a standby's pool, grown at promotion)")
        self._blocked = stuck
        return stuck

    def step(self, deliver: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """Prefill what is pending (while others decode, at most ``prefill_chunk`` prompt tokens in
        all, so a long prompt does not stall them), then one decode step for the rest. On CUDA, when
        the prompt tokens and the decoding rows fit a captured step graph (``--graph-tokens``), all
        of it is one graph replay instead (``_step_rows``).
        ``deliver``: called with each prefill forward's outputs as soon as they are sampled, before the
        step's next forward (a promoted standby prefills every migrated stream in one step, in several
        forwards: the first streams' next tokens need not wait for the last ones'); what it was given
        is not in the list returned."""
        outputs, t0 = [], time.perf_counter()

        def prefilled(out: list[RequestOutput]) -> None:
            if deliver is not None and out:
                deliver(out)
            else:
                outputs.extend(out)

        prefill, decode = self.scheduler.schedule()
        budget = self.prefill_chunk if decode and self.prefill_chunk else None
        pieces = []  # (sequence, prompt tokens it prefills this step)
        for seq in prefill:
            n = seq.pending if budget is None else min(seq.pending, budget)
            if n <= 0:
                break
            pieces.append((seq, n))
            budget = None if budget is None else budget - n
        pieces = self._fit_rows(decode, pieces)
        whole = [(s, n) for s, n in pieces if n == s.length]
        parts = [(s, n) for s, n in pieces if n != s.length]
        rows = len(decode) + sum(n for _, n in pieces)
        if pieces and self.runner.can_run_rows(rows):  # one graph replay: prompt tokens as rows
            outputs = self._step_rows(decode, pieces)
        else:
            rows = 0
            for group in _prefill_groups([s for s, _ in whole], self.prefill_tokens):
                plan = StepPlan("prefill", tuple(tuple(s.all_ids) for s in group), block_tables=_tables(group))
                prefilled(self._prefilled(group, self.runner.run(plan)))
            for seq, n in parts:  # a chunk: one forward of its own, from where the last one stopped
                start = seq.length - seq.pending
                plan = StepPlan("prefill", (tuple(seq.all_ids[start:start + n]),), (start,), _tables([seq]))
                prefilled(self._prefilled([seq], self.runner.run(plan), n))
            if decode:
                plan = StepPlan("decode", tuple(s.last_token for s in decode), tuple(s.length - 1 for s in decode),
                                _tables(decode))
                outputs += self._advance(decode, self.runner.run(plan))
        end = time.perf_counter()
        if t0 - self._last_step_end > IDLE_S:  # the first steps after idle: a promoted standby's first
            self._log_steps = 6
        if end - t0 > SLOW_STEP_S or self._log_steps:  # what a slow step held (a long prompt, ...)
            self._log_steps = max(0, self._log_steps - 1)
            log.info("step_slow" if end - t0 > SLOW_STEP_S else "step_after_idle", ms=round((end - t0) * 1e3, 1),
                     idle_ms=round((t0 - self._last_step_end) * 1e3, 1), prefill_seqs=len(whole),
                     prefill_tokens=sum(n for _, n in whole), chunks=len(parts),
                     chunk_tokens=sum(n for _, n in parts), decode_rows=len(decode), graph_rows=rows)
        self._last_step_end = end
        return outputs

    def _fit_rows(self, decode: list[Sequence], pieces: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Prefill that overflows the largest step graph by at most as much again is cut to fit it
        (the rest is prefilled next step, as a chunk): two replays still beat one eager forward
        (on an H200, 48 layers: ~16 ms each against 90-140 ms for ~300 migrated stream tokens),
        while a longer prompt is prefilled eagerly in one forward (its first token sooner)."""
        limit = self.runner.graph_rows
        rows = len(decode) + sum(n for _, n in pieces)
        if not pieces or rows <= limit or rows > 2 * limit or not self.runner.can_run_rows(limit):
            return pieces
        room, fitted = limit - len(decode), []
        if room <= 0:  # no row left for prefill beside these decodes: not starved, prefilled eagerly
            return pieces
        for seq, n in pieces:
            if room <= 0:
                break
            fitted.append((seq, min(n, room)))
            room -= n
        return fitted

    def _step_rows(self, decode: list[Sequence], pieces: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        """The whole step as one forward of one token per row: each decoding sequence's last token,
        then each prefilled sequence's tokens in position order; logits for the decode rows and for
        the last row of each prefill that ends here (a partial chunk samples nothing)."""
        tokens = [s.last_token for s in decode]
        positions = [s.length - 1 for s in decode]
        tables = [tuple(s.block_table) for s in decode]
        sampled, rows = list(decode), list(range(len(decode)))
        for seq, n in pieces:
            start, table = seq.length - seq.pending, tuple(seq.block_table)
            tokens += seq.all_ids[start:start + n]
            positions += range(start, start + n)
            tables += [table] * n
            seq.pending -= n
            if not seq.pending:
                sampled.append(seq)
                rows.append(len(tokens) - 1)
        self.row_steps += 1
        logits = self.runner.run(StepPlan("rows", tuple(tokens), tuple(positions), tuple(tables),
                                          sample_rows=tuple(rows)))
        return self._advance(sampled, logits)

    def _prefilled(self, seqs: list[Sequence], logits, chunk: int | None = None) -> list[RequestOutput]:
        """Sample the sequences whose prefill this forward finished; a partial chunk samples nothing."""
        for seq in seqs:
            seq.pending -= seq.pending if chunk is None else chunk
        if seqs[0].pending:
            return []
        return self._advance(seqs, logits)

    def _advance(self, seqs: list[Sequence], logits) -> list[RequestOutput]:
        tokens = sample(logits, [Draw(s.params, s.seed, s.length) for s in seqs], self.runner.greedy)
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

    def resize_kv(self, budget: int) -> KVUsage:
        """Bring the KV pool (per rank) as close to ``budget`` bytes as it may go, between two steps,
        with sequences running: grow by new chunks, shrink by releasing free tail chunks (never a used
        block: a shrink stops short where one is in the way). The pool stays within one ``max_len``
        context .. ``max_batch`` of them. Runs on every rank; returns what it reached."""
        kv, blocks = self.runner.kv, self.scheduler.blocks
        chunks = kv.plan_resize(budget, blocks.free_tail())
        if chunks != kv.chunk_blocks:
            try:
                self.runner.run(StepPlan("resize", chunks=chunks))
            finally:  # a failed replacement chunk (out of memory) leaves the pool at the chunks it kept
                blocks.resize(kv.num_blocks)
        return self.kv_usage()

    def capture_graph(self) -> bool:
        """Capture the next CUDA graph of decode (between two steps); False when none is left."""
        if not self.runner.graphs_pending:
            return False
        self.runner.run(StepPlan("capture"))
        return self.runner.graphs_pending

    def kv_usage(self) -> KVUsage:
        blocks = self.scheduler.blocks
        return KVUsage(self.runner.kv.nbytes, blocks.num_blocks, blocks.num_used, blocks.block_size,
                       self.scheduler.preemptions)

    def warmup(self, batch: int = 1) -> None:
        """One prefill and one decode through the whole stack (every rank), so the first request
        pays no lazy initialisation; uses the pool's first blocks and leaves no sequence behind.

        ``batch > 1`` then runs one wave of that many short greedy sequences to the end (capped by
        what the pool holds), so the kernels and allocator blocks of a full batch exist before the
        first request. The slow first use of each attention shape that cuDNN has is avoided by
        not using cuDNN attention (``cudnn_attention``), which a warm-up could not cover."""
        n = min(5, self.max_len)
        table = (tuple(range(-(-n // self.runner.kv.block_size))),)
        t0 = time.perf_counter()
        self.runner.run(StepPlan("prefill", (tuple(range(n - 1)),), block_tables=table))
        t1 = time.perf_counter()
        logits = self.runner.run(StepPlan("decode", (n - 1,), (n - 1,), table))
        sample(logits, [Draw(SamplingParams(temperature=0.0), 0, n)], self.runner.greedy)  # waits for the step
        log.info("warmup_first_steps", prefill_ms=round((t1 - t0) * 1e3, 1),
                 decode_ms=round((time.perf_counter() - t1) * 1e3, 1))
        prompt, new = min(32, self.max_len // 2), min(16, self.max_len // 4)
        per_seq = -(-(prompt + new) // self.runner.kv.block_size)
        batch = min(batch, self.scheduler.blocks.num_free // per_seq)
        if batch <= 1 or new < 2:
            return
        seqs = [Sequence(f"warmup-{i}", [(7 * i + j) % 100 + 3 for j in range(prompt)],
                         SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True), 0) for i in range(batch)]
        for seq in seqs:
            self.add(seq)
        while self.has_work():
            self.step()
        self.scheduler.preemptions = 0  # the warm-up's own, if any, are not the service's


def _tables(seqs: list[Sequence]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(s.block_table) for s in seqs)


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
