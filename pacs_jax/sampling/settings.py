"""Sampling settings of one sampler call (n, budget, temperature, top-k / top-p, stop ids), checked on construction."""

from __future__ import annotations

import dataclasses
import math
import numbers


# config values: a fixed number of decode slots, one slot per row, or a fixed number over a page pool
SAMPLERS = ("continuous", "static", "paged")
# which B groups a carry-over call returns (sampling/carry_over.py): the first complete (the default), or the oldest
CARRY_OVER_ORDERS = ("completion", "admission")
DECODE_CHUNK_STEPS = 16  # decode steps a program of the decode loop (docs/design.md section 3.2 says why)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How to sample: budget, samples per prompt, and the rules that pick each token.

    max_new_tokens: generated tokens per sample (>= 1), the stop token included.
    n: samples per prompt (>= 1); they share the prompt's prefill.
    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_p: nucleus mass in (0, 1]; 1 disables it. top_k: 0 disables it. Both are ignored when greedy.
    stop_token_ids: a sample ends at the first of these (kept in its output).
    slots: decode slots of a call (continuous batching: a slot whose row ends takes the next waiting
    row); None gives every row its own slot (static batching: the call runs until its longest row
    ends). At most the call's rows (prompts x n); on a mesh, a multiple of the batch shards keeps
    one queue per shard.
    tail_slots: once no row is waiting, the decode batch narrows as its rows end, width by width
    (``engine.narrowing_widths``: 2/3 to 3/4 of the width above each time) down to ``tail_slots``, so
    a call's long tail decodes only the slots still running; None: the call runs all its slots to
    the end. At most ``slots``; on a mesh, per queue it is tail_slots / batch shards (at least 1).
    page_size: None: each slot holds a K/V cache row of prompt + max_new_tokens; an int: the paged
    sampler (sampling/paged.py), K/V in a pool of pages of this many tokens, each prompt's pages
    shared by its n samples, a row's pages taken as it grows and returned when it ends.
    pages: with page_size, the response pages of each queue's pool (a queue per batch shard); None:
    enough for every slot's longest row at once. A row waits for pages when too few are free.
    chunk_steps: decode steps a program of the decode loop runs (engine.sample): between two the
    host reads the call's progress and may stop it. The tokens do not depend on it.
    record_routing: a model with experts (models/moe.py): the call also returns the experts every prompt
    and response token went through in every layer, as the prefill and the decode steps chose them
    (``engine.SampleArrays.prompt_routing`` / ``routing``; routing replay R3).
    """

    max_new_tokens: int
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    slots: int | None = None
    tail_slots: int | None = None
    page_size: int | None = None
    pages: int | None = None
    chunk_steps: int = DECODE_CHUNK_STEPS
    record_routing: bool = False

    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: must be an integer >= 1")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n={self.n!r}: must be an integer >= 1")
        if not isinstance(self.temperature, numbers.Real) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r}: must be a finite number >= 0")
        if not isinstance(self.top_p, numbers.Real) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 disables it)")
        if self.slots is not None and (not _is_int(self.slots) or self.slots < 1):
            raise ValueError(f"slots={self.slots!r}: must be an integer >= 1 (or None: one per row)")
        if self.tail_slots is not None and (not _is_int(self.tail_slots) or self.tail_slots < 1
                                            or self.slots is None or self.tail_slots > self.slots):
            raise ValueError(f"tail_slots={self.tail_slots!r}: must be an integer in [1, slots={self.slots}] "
                             "(continuous batching), or None: no narrowing")
        if self.page_size is not None and (not _is_int(self.page_size) or self.page_size < 1):
            raise ValueError(f"page_size={self.page_size!r}: must be an integer >= 1 (or None: no pages)")
        if self.pages is not None and (not _is_int(self.pages) or self.pages < 1 or self.page_size is None):
            raise ValueError(f"pages={self.pages!r}: must be an integer >= 1, with page_size (or None)")
        if not _is_int(self.chunk_steps) or self.chunk_steps < 1:
            raise ValueError(f"chunk_steps={self.chunk_steps!r}: must be an integer >= 1")
        stops = self.stop_token_ids
        if isinstance(stops, numbers.Integral):
            stops = (stops,)
        stops = tuple(stops)
        for i, token in enumerate(stops):
            if not _is_int(token) or token < 0:
                raise ValueError(f"stop_token_ids[{i}]={token!r}: must be a non-negative integer")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def sampler(self) -> str:
        """The sampler these settings run (one of SAMPLERS): "paged" with a page_size, else "static"
        without slots, else "continuous"."""
        if self.page_size is not None:
            return "paged"
        return "static" if self.slots is None else "continuous"

    def check_vocab(self, vocab_size: int) -> None:
        """Raise a ValueError naming the field when a token id or top_k does not fit the vocabulary."""
        if self.top_k > vocab_size:
            raise ValueError(f"top_k={self.top_k}: larger than the vocabulary ({vocab_size})")
        for i, token in enumerate(self.stop_token_ids):
            if token >= vocab_size:
                raise ValueError(f"stop_token_ids[{i}]={token}: outside the vocabulary ({vocab_size})")


def row_pages(page_size: int, max_new_tokens: int) -> int:
    """The paged sampler's most response pages for one row: a partly filled prompt page (up to
    page_size - 1 tokens) plus the K/V of max_new_tokens - 1 decoded tokens (the last token's is
    never written)."""
    return math.ceil((page_size - 1 + max_new_tokens - 1) / page_size)


def call_slots(slots: int | None, rows: int) -> int:
    """The decode slots of one sampler call of ``rows`` rows (its prompts x n): ``slots`` capped at
    ``rows``, or ``rows`` (one slot per row: static batching) when ``slots`` is None. On a mesh the
    result should be a multiple of the batch shards (data x fsdp) for one queue per shard."""
    return rows if slots is None else min(slots, rows)
