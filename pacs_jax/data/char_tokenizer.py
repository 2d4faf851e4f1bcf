"""A character-level tokenizer with the slice of the Hugging Face tokenizer interface the trainer uses
(``data.tokenizer = "char"``), for tiny models on a small alphabet (the arithmetic task of
configs/default.py): a 151k-token vocabulary would dominate a 2-layer model's cost.

Its "chat template" renders the single user message as ``Q: {message} A: ``.
"""

from __future__ import annotations

from collections.abc import Sequence

PAD, EOS = "<pad>", "<eos>"
# why an HF export of a run with this tokenizer has no tokenizer files, and what to use instead
NO_HF_TOKENIZER = ("the run's tokenizer is the character tokenizer (data.tokenizer=\"char\"), which has no Hugging "
                   "Face files: encode and decode with pacs_jax.data.CharTokenizer() instead")
CHARS = "0123456789+-*=?.,:;!'()\\{}$ abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


class CharTokenizer:
    """Id 0 is padding, id 1 end-of-sequence, then one id per character of ``chars``."""

    def __init__(self, chars: str = CHARS):
        self.itos = [PAD, EOS, *chars]
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.pad_token_id, self.eos_token_id = 0, 1

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self.stoi})
        if unknown:
            raise ValueError(f"CharTokenizer: characters {unknown} are not in its vocabulary")
        return [self.stoi[c] for c in text]

    def __call__(self, texts: Sequence[str], add_special_tokens: bool = False) -> dict[str, list[list[int]]]:
        """{"input_ids": one id list per text} (there are no special tokens to add)."""
        return {"input_ids": [self.encode(t) for t in texts]}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        special = (self.pad_token_id, self.eos_token_id)
        return "".join(self.itos[int(i)] for i in ids if not (skip_special_tokens and int(i) in special))

    def apply_chat_template(self, messages: Sequence[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        """``Q: {message} A: `` for one user message (the only conversation the trainer builds)."""
        if tokenize or not add_generation_prompt or len(messages) != 1 or messages[0]["role"] != "user":
            raise ValueError("CharTokenizer renders one user message, untokenized, with the answer prompt")
        return f"Q: {messages[0]['content']} A: "
