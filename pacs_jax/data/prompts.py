"""Prompts: the problem and the instruction of docs/design.md section 7.3, in the tokenizer's chat template.

The instruction is ``data.instruction`` of a config (default ``INSTRUCTION``; "" for none).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence

from pacs_jax.data import paths
from pacs_jax.data.char_tokenizer import CharTokenizer
from pacs_jax.data.records import Problem

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CHAR_TOKENIZER = "char"


@dataclasses.dataclass(frozen=True)
class PromptExample:
    """A problem and its rendered, tokenized prompt."""

    prompt_ids: tuple[int, ...]  # [prompt length] token ids, ending with the assistant turn header
    problem: Problem


def load_tokenizer(path: str | pathlib.Path):
    """The Hugging Face tokenizer in ``path`` (e.g. data/tokenizers/qwen3 or a model folder), or
    ``"char"``: the character tokenizer (data/char_tokenizer.py)."""
    if str(path) == CHAR_TOKENIZER:
        return CharTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(paths.resolve(path)))  # relative: the working directory's, else
                                                                    # the repository root's (data/paths.py)


def user_message(problem: str, instruction: str = INSTRUCTION) -> str:
    """The single user message: the problem text, one space, the instruction (if any)."""
    return f"{problem} {instruction}" if instruction else problem


def render_prompt(tokenizer, problem: str, instruction: str = INSTRUCTION) -> str:
    """The chat-template text of the user message, with the assistant generation header."""
    return tokenizer.apply_chat_template([{"role": "user", "content": user_message(problem, instruction)}],
                                         tokenize=False, add_generation_prompt=True)


def build_prompts(problems: Sequence[Problem], tokenizer, max_prompt_length: int,
                  instruction: str = INSTRUCTION) -> tuple[list[PromptExample], int]:
    """Render and tokenize every problem; prompts longer than ``max_prompt_length`` tokens are dropped.

    Returns (examples in input order, number dropped). Nothing is truncated.
    """
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length={max_prompt_length}: must be >= 1")
    if not problems:
        return [], 0
    texts = [render_prompt(tokenizer, p.problem, instruction) for p in problems]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    examples = [PromptExample(tuple(tokens), problem) for tokens, problem in zip(ids, problems)
                if len(tokens) <= max_prompt_length]
    return examples, len(problems) - len(examples)
