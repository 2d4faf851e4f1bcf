"""The demo's self-made verifiable task: arithmetic word problems answered in \\boxed{}.

Problems are generated from a seed (no download), tokenized by a character-level tokenizer (the
demo model is tiny, so a 151k-token vocabulary would dominate its cost), and graded by the same
``rewards.math_reward`` as the real math runs.
"""

from __future__ import annotations

import dataclasses
import random

PAD, EOS = "<pad>", "<eos>"
_CHARS = "0123456789+-*=?.,:;!'()\\{}$ abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

_TEMPLATES = (
    ("{name} has {a} {item}s and gets {b} more. How many now?", "+"),
    ("{name} has {a} {item}s and loses {b}. How many left?", "-"),
    ("A box has {a} {item}s. {name} adds {b}. How many now?", "+"),
    ("A box has {a} {item}s. {name} takes {b}. How many left?", "-"),
)
_NAMES = ("Ann", "Bob", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal")
_ITEMS = ("pen", "coin", "book", "cup", "card")


class CharTokenizer:
    """Character-level tokenizer: id 0 is padding, id 1 end-of-sequence, then one id per character."""

    def __init__(self, chars: str = _CHARS):
        self.itos = [PAD, EOS, *chars]
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.pad_id, self.eos_id = 0, 1

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self.stoi})
        if unknown:
            raise ValueError(f"CharTokenizer: characters {unknown} are not in the vocabulary")
        return [self.stoi[c] for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i in (self.pad_id, self.eos_id):
                if skip_special_tokens:
                    continue
            out.append(self.itos[i])
        return "".join(out)


@dataclasses.dataclass(frozen=True)
class Problem:
    problem: str
    ground_truth: str
    data_source: str = "arithmetic"

    @property
    def prompt(self) -> str:
        return f"Q: {self.problem} A: "

    @property
    def solution(self) -> str:
        """The supervised target of the warm-start: the answer in the format the reward parses."""
        return f"\\boxed{{{self.ground_truth}}}"


def make_problems(count: int, seed: int, max_operand: int = 99) -> list[Problem]:
    """``count`` distinct problems (a +/- b, answers >= 0) drawn deterministically from ``seed``."""
    distinct = max_operand * max_operand + max_operand * (max_operand + 1) // 2  # a+b pairs, a-b with a >= b
    if count > distinct:
        raise ValueError(f"demo: {count} distinct problems requested, operands up to {max_operand} give {distinct}")
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < count:
        template, op = rng.choice(_TEMPLATES)
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        if op == "-" and b > a:
            a, b = b, a
        key = (a, op, b)
        if key in seen:
            continue
        seen.add(key)
        text = template.format(name=rng.choice(_NAMES), item=rng.choice(_ITEMS), a=a, b=b)
        out.append(Problem(text, str(a + b if op == "+" else a - b)))
    return out


def split_problems(total: int, held_out: int, seed: int, max_operand: int = 99) -> tuple[list[Problem], list[Problem]]:
    """(train, held_out) problem lists with no (a, op, b) shared between them."""
    problems = make_problems(total + held_out, seed, max_operand)
    return problems[:total], problems[total:]
