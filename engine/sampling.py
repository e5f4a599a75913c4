"""Token selection: greedy, or temperature + top-p with an RNG keyed by (seed, position).

Keying the draw by the token's position in the sequence (not by how many draws this process made)
is what lets a request resumed on another engine, with the tokens already sent appended to its
prompt, draw exactly the tokens an uninterrupted run would have drawn.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        assert self.temperature >= 0 and 0 < self.top_p <= 1 and self.max_tokens >= 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True)
class Draw:
    """What the sampler needs of one row: its params, a seed (fixed per request) and the position of
    the token being drawn."""

    params: SamplingParams
    seed: int
    position: int = field(default=0)


def request_seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh random one: unseeded requests are random across requests but
    still reproducible within one (each position keyed the same way)."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def position_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): a well-mixed 63-bit seed per drawn token."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``; renormalize."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def sample(logits: torch.Tensor, draws: list[Draw], greedy: torch.Tensor | None = None) -> list[int]:
    """logits [B, V] float32 (any device) -> one token id per row. ``greedy``: the rows' argmax,
    already taken on the device (one copy back instead of an argmax here)."""
    greedy = (logits.argmax(-1) if greedy is None else greedy).tolist()
    out = []
    for row, draw in enumerate(draws):
        if draw.params.greedy:
            out.append(greedy[row])
            continue
        probs = torch.softmax(logits[row].float().cpu() / draw.params.temperature, -1)
        probs = top_p_filter(probs, draw.params.top_p)
        gen = torch.Generator().manual_seed(position_seed(draw.seed, draw.position))
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
