"""Datasets: readers of the native formats, prompt building, the grain prompt pipeline.

    problems, stats = data.load_problems("data/math_500/test.jsonl")
    train, warm, held_out, counts = data.training_problems(config.data, seed=config.seed)  # a config's data
    examples, dropped = data.build_prompts(train, tokenizer, max_prompt_length=512)
    batches = data.prompt_iterator(examples, data.PipelineConfig(batch_size=256, seed=0))
    folder = data.local_folder("gs://bucket/tokenizer")   # a gs:// folder's local copy (data/remote.py)
"""

import importlib

from pacs_jax.data.prompts import (CHAR_TOKENIZER, INSTRUCTION, MODEL_TOKENIZER, PromptExample, TokenizerChoiceError,
                                   build_prompts, load_tokenizer, render_prompt, run_tokenizer, user_message)
from pacs_jax.data.char_tokenizer import CharTokenizer
from pacs_jax.data.sources import SOURCES, training_problems
from pacs_jax.data.fields import FORMATS, FieldMap, ReadStats, convert_rows
from pacs_jax.data.readers import load_problems, read_problems
from pacs_jax.data.records import DataError, Problem
from pacs_jax.data.remote import local_folder

__all__ = ["Problem", "DataError", "FORMATS", "FieldMap", "ReadStats", "load_problems", "read_problems", "convert_rows",
           "INSTRUCTION", "PromptExample", "build_prompts", "load_tokenizer", "render_prompt", "user_message",
           "PipelineConfig", "prompt_batches", "prompt_iterator", "CHAR_TOKENIZER", "CharTokenizer", "SOURCES",
           "training_problems", "MODEL_TOKENIZER", "TokenizerChoiceError", "run_tokenizer", "local_folder"]

# The grain pipeline (PipelineConfig, prompt_batches, prompt_iterator), imported on first use (``__getattr__``): grain
# and the Orbax it imports cost a process ~0.3-0.9 s of CPU, which one that only reads data or paths (the trainer's
# command line before its config checks, the evaluator, the tools) never uses
_PIPELINE = ("PipelineConfig", "prompt_batches", "prompt_iterator")


def __getattr__(name: str):
    if name in _PIPELINE:
        return getattr(importlib.import_module("pacs_jax.data.pipeline"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
