"""Stop ids of training and evaluation: config.json's eos, generation_config.json's eos ids (Qwen3
lists [151645, 151643] there), the tokenizer's eos and ``rollout.stop_token_ids``."""

from __future__ import annotations

import json

import pytest

from pacs_jax import checkpoints, data, evaluation, models
from pacs_jax.models.config import merge_eos_ids
from pacs_jax.training.engine.sampler_programs import sampling_settings
from pacs_jax.training.spec import RunSpec
from qwen_reference import save_random_hf_model
from train_helpers import load_config

IM_END, END_OF_TEXT = 151645, 151643
# generation_config.json of Qwen/Qwen3-0.6B as published on the Hugging Face hub.
QWEN3_GENERATION_CONFIG = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                           "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                           "transformers_version": "4.51.0"}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A random Qwen3 with the real vocabulary and config.json's eos 151645, as Qwen3 ships it."""
    directory = tmp_path_factory.mktemp("stop_ids") / "qwen3"
    save_random_hf_model("qwen3_tied_head_dim24", directory, vocab_size=151936, bos_token_id=END_OF_TEXT,
                         eos_token_id=IM_END)
    (directory / "generation_config.json").unlink(missing_ok=True)
    assert json.loads((directory / "config.json").read_text())["eos_token_id"] == IM_END
    return directory


def test_qwen3_stop_ids_include_generation_configs_eos(qwen3_dir, qwen_tokenizer_dir):
    tokenizer = data.load_tokenizer(str(qwen_tokenizer_dir))
    without = checkpoints.from_pretrained(qwen3_dir)
    assert evaluation.default_stop_ids(without, tokenizer) == (IM_END,)  # config.json and the tokenizer: <|im_end|>

    (qwen3_dir / "generation_config.json").write_text(json.dumps(QWEN3_GENERATION_CONFIG, indent=2))
    model = checkpoints.from_pretrained(qwen3_dir)
    assert model.cfg.eos_token_id == (IM_END, END_OF_TEXT)
    stops = evaluation.default_stop_ids(model, tokenizer)
    assert END_OF_TEXT in stops and IM_END in stops

    # the trainer's sampler stops on them and on rollout.stop_token_ids
    config = load_config("default.py")
    config.rollout.stop_token_ids = (7, IM_END)
    assert sampling_settings(RunSpec.unplaced(config), stops).stop_token_ids == (END_OF_TEXT, IM_END, 7)
    # exported and read back, the stop ids stay
    exported = models.export_hf(model, qwen3_dir.parent / "exported")
    assert models.QwenConfig.from_hf_file(exported).eos_token_id == (IM_END, END_OF_TEXT)


def test_merge_eos_ids():
    assert merge_eos_ids(IM_END, [IM_END, END_OF_TEXT]) == (IM_END, END_OF_TEXT)
    assert merge_eos_ids(END_OF_TEXT, END_OF_TEXT) == END_OF_TEXT
    assert merge_eos_ids(None, [3]) == 3
    assert merge_eos_ids(None, None) is None
