"""The prompts of one sampler call or step, as the trainer's prompt source gives them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Prompts of one step: token ids, gold answers and where each came from (same length)."""

    prompt_ids: Sequence[Sequence[int]]
    ground_truths: Sequence[str]
    data_sources: Sequence[str]
