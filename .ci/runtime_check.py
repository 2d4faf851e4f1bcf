"""CI: the README's runtime install (requirements.txt alone, no test extras) can run a real model's prompts.

    python .ci/runtime_check.py    # in a virtual environment made with `pip install -r requirements.txt -e .`

Loads the shipped Qwen tokenizer (data/tokenizers/qwen3) and renders and tokenizes one prompt through
the trainer's own code (pacs_jax/data/prompts.py), which needs the chat-template dependencies
(jinja2) that the test requirements would otherwise pull in through torch. It refuses to run where
torch is installed, since that environment would hide a missing runtime requirement. Exits 0 and
prints one line on success.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def main() -> int:
    if importlib.util.find_spec("torch") is not None:
        print("runtime_check.py: torch is installed here: run it in a venv made from requirements.txt alone",
              file=sys.stderr)
        return 1
    from pacs_jax.data.prompts import build_prompts, load_tokenizer
    from pacs_jax.data.records import Problem

    tokenizer = load_tokenizer(REPO / "data" / "tokenizers" / "qwen3")
    problem = Problem(data_source="ci", problem="What is 2 + 3?", ground_truth="5", index=0)
    examples, dropped = build_prompts([problem], tokenizer, max_prompt_length=256)
    text = tokenizer.decode(list(examples[0].prompt_ids)) if examples else ""
    if dropped or "<|im_start|>assistant" not in text or "What is 2 + 3?" not in text:
        print(f"runtime_check.py: unexpected prompt from data/tokenizers/qwen3: {text!r}", file=sys.stderr)
        return 1
    print(f"runtime_check.py: requirements.txt alone renders a Qwen chat prompt ({len(examples[0].prompt_ids)} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
