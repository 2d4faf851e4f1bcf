"""Prompts: the problem and the instruction of docs/design.md section 7.3, in the tokenizer's chat template.

The instruction is ``data.instruction`` of a config (default ``INSTRUCTION``; "" for none). The
tokenizer of a run (``run_tokenizer``): ``data.tokenizer`` "" is the model's own (the tokenizer files
in ``model.path``), whose chat template and end of sequence are the ones the model was released
with (a Qwen2.5 base model's template puts its default system prompt before the user turn and ends
at ``<|endoftext|>``; Qwen3's has no default system prompt and ends at ``<|im_end|>``). A folder of
another model family than ``model.path``'s is refused unless ``data.tokenizer_force``. Both may be
``gs://`` folders: their JSON files are read from the store, and ``load_tokenizer`` loads a local copy
(data/remote.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from collections.abc import Mapping, Sequence

from etils import epath

from pacs_jax.data import paths, remote
from pacs_jax.data.char_tokenizer import CharTokenizer
from pacs_jax.data.records import Problem

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CHAR_TOKENIZER = "char"
MODEL_TOKENIZER = ""  # data.tokenizer: the tokenizer files of model.path (the model's own)
REPOSITORY_TOKENIZER = "data/tokenizers/qwen3"  # "" without model.path: random weights have no tokenizer of their
                                                # own; every Qwen2 / Qwen2.5 / Qwen3 model has this vocabulary
TOKENIZER_CONFIG = "tokenizer_config.json"  # what a tokenizer folder must hold (its chat template, eos)
FAMILIES = {"qwen2": "Qwen2 / Qwen2.5", "qwen3": "Qwen3"}  # a config.json model_type -> its family's name
# Qwen3's tokenizer adds <think> and </think> (ids 151667, 151668) to the Qwen2 / Qwen2.5 special tokens
# (ids 151643-151664); all of them add the ChatML <|im_start|> (151644).
QWEN3_MARKER, QWEN_MARKER = "<think>", "<|im_start|>"


@dataclasses.dataclass(frozen=True)
class PromptExample:
    """A problem and its rendered, tokenized prompt."""

    prompt_ids: tuple[int, ...]  # [prompt length] token ids, ending with the assistant turn header
    problem: Problem


class _NoPyTorchAdvice(logging.Filter):
    """Drops transformers' import-time advice that PyTorch was not found ("Models won't be available"): a
    runtime install has no PyTorch (requirements.txt) and uses only transformers' tokenizers."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


def load_tokenizer(path: str | pathlib.Path):
    """The Hugging Face tokenizer in ``path`` (e.g. data/tokenizers/qwen3 or a model folder), or
    ``"char"``: the character tokenizer (data/char_tokenizer.py)."""
    if str(path) == CHAR_TOKENIZER:
        return CharTokenizer()
    advice = logging.getLogger("transformers")  # the logger of transformers/__init__.py, which gives it
    if not any(isinstance(f, _NoPyTorchAdvice) for f in advice.filters):
        advice.addFilter(_NoPyTorchAdvice())
    from transformers import AutoTokenizer

    # relative: the working directory's, else the repository root's; gs://: a local copy (data/remote.py)
    return AutoTokenizer.from_pretrained(str(remote.local_folder(path)))


class TokenizerChoiceError(ValueError):
    """The configured tokenizer cannot be used for the run's model; ``field`` is the config field
    (under ``config.``) to change, and the message says why and how."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _same_folder(a: str, b: str) -> bool:
    """Whether folders ``a`` and ``b`` are one (local: after resolving links; gs://: the same name)."""
    if paths.is_remote(a) or paths.is_remote(b):
        return str(a).rstrip("/") == str(b).rstrip("/")
    return pathlib.Path(a).resolve() == pathlib.Path(b).resolve()


def _read_json(path: epath.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def model_family(model_path: str | pathlib.Path) -> tuple[str | None, str]:
    """(model_type, where it was read) of the model in ``model_path``: its config.json (an HF folder) or
    model_config.json (a pacs_jax checkpoint: the folder, or the trainer root above one of its step
    folders); (None, "") when there is neither."""
    folder = paths.path(model_path)
    for path in (folder / "config.json", folder / "model_config.json", folder.parent / "model_config.json"):
        model_type = _read_json(path).get("model_type") if path.is_file() else None
        if model_type:
            return model_type, f"{path.name} model_type {model_type!r}"
    return None, ""


def tokenizer_family(folder: str | pathlib.Path) -> tuple[str | None, str]:
    """(family as a model_type, the evidence) of the tokenizer in ``folder``: the model_type of a
    config.json beside it (a model folder says what it is), else its added tokens: Qwen3's include
    ``<think>``, Qwen2's and Qwen2.5's have ``<|im_start|>`` but not ``<think>``; (None, evidence) for
    a tokenizer with neither (not a Qwen one)."""
    folder = paths.path(folder)
    model_type, where = model_family(folder) if (folder / "config.json").is_file() else (None, "")
    if model_type:
        return model_type, f"the model folder's {where}"
    tokens = set()
    config = _read_json(folder / TOKENIZER_CONFIG)
    tokens.update(t.get("content") for t in config.get("added_tokens_decoder", {}).values() if isinstance(t, dict))
    tokens.update(t.get("content") for t in _read_json(folder / "tokenizer.json").get("added_tokens", [])
                  if isinstance(t, dict))
    tokens.update(_read_json(folder / "added_tokens.json"))
    if QWEN3_MARKER in tokens:
        return "qwen3", f"its added tokens include {QWEN3_MARKER}"
    if QWEN_MARKER in tokens:
        return "qwen2", f"its added tokens include {QWEN_MARKER} but not {QWEN3_MARKER}"
    return None, f"its added tokens include neither {QWEN_MARKER} nor {QWEN3_MARKER}"


def _family_name(model_type: str | None) -> str:
    return FAMILIES.get(model_type, f"{model_type!r}") if model_type else "no Qwen family"


def run_tokenizer(data_config: Mapping, model_path: str = "") -> str:
    """What ``load_tokenizer`` loads for a run: ``"char"``, or the folder of its HF tokenizer files.

    ``data_config`` is a config's ``data`` (``tokenizer``, ``tokenizer_force``). ``data.tokenizer`` ""
    (the paper configs' default) is the model's own tokenizer: the files in ``model_path`` (the
    model's stop ids, which ``evaluation.default_stop_ids`` takes from its config.json and
    generation_config.json, then agree with the tokenizer's eos); without ``model_path`` (random
    weights: the tests' shrunk setups, throughput runs) the repository's Qwen tokenizer
    (``REPOSITORY_TOKENIZER``). A folder is taken as given when it is
    ``model_path`` itself, when ``model_path`` is empty (a random initialisation has no tokenizer of
    its own) or says no model_type, and when its family (``tokenizer_family``) is the model's
    (``model_family``); a folder of another family is refused unless ``data.tokenizer_force``. Raises
    ``TokenizerChoiceError`` naming the field to change."""
    name = data_config["tokenizer"]
    force = bool(data_config.get("tokenizer_force", False))
    if name == CHAR_TOKENIZER:
        return CHAR_TOKENIZER
    if name == MODEL_TOKENIZER:
        if not model_path:
            return str(paths.resolve(REPOSITORY_TOKENIZER))
        if not (paths.path(model_path) / TOKENIZER_CONFIG).is_file():
            raise TokenizerChoiceError("data.tokenizer", f"empty, i.e. the model's own tokenizer, but model.path "
                                       f"{model_path} has no tokenizer files ({TOKENIZER_CONFIG}; a pacs_jax "
                                       f"checkpoint keeps none): set data.tokenizer to the folder of the model's "
                                       f"tokenizer")
        return str(model_path)
    folder = str(paths.resolve(name))
    if not model_path or _same_folder(folder, model_path):
        return folder
    model_type, where = model_family(model_path)
    family, evidence = tokenizer_family(folder)
    if model_type is None or family == model_type or force:
        return folder
    raise TokenizerChoiceError(
        "data.tokenizer", f"{name} is a tokenizer of {_family_name(family)} ({evidence}), but model.path "
        f"{model_path} is a {_family_name(model_type)} model ({where}): its chat template and end of sequence "
        f"are not the model's. Leave data.tokenizer empty for the model's own tokenizer (the files in "
        f"model.path), or set data.tokenizer_force=True to use this one anyway")


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
