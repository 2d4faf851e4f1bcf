"""A run's tokenizer is its model's own (issue 26 item 3): ``data.tokenizer`` "" (the paper configs'
default) loads the tokenizer files of ``model.path``. A Qwen2.5 base model folder with its own
tokenizer gives that tokenizer's chat template (the default system prompt) in the prompts, its stop
ids (``<|endoftext|>`` only, from config.json, generation_config.json and the tokenizer's eos) in the
sampler, and its tokenizer files in the HF export; a tokenizer folder of another model family is
refused, naming both families, unless ``data.tokenizer_force``.

The Qwen2.5 folder is built here: a tiny random Qwen2 (transformers) and the real Qwen BPE files of
data/tokenizers/qwen3 (vocab.json and merges.txt are the same for Qwen2, Qwen2.5 and Qwen3,
data/README.md) with Qwen2.5's tokenizer_config.json settings (below).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from pacs_jax import data
from pacs_jax.training import rollout
from pacs_jax.training.config_check import ConfigError, validate_config
from train_helpers import REPO, load_config, without_torch
from test_train_real_config import (_train, deepscaler_rows, one_prompt_bucket,  # noqa: F401 (a fixture)
                                    shrunk_paper_config)

# The chat_template of the tokenizer_config.json published with Qwen/Qwen2.5-7B (and the other Qwen2.5
# base and instruct models) on the Hugging Face hub: without a system message of its own, the
# conversation starts with the default system prompt "You are Qwen, created by Alibaba Cloud. ...".
QWEN25_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Qwen/Qwen2.5-3B's generation_config.json (a base model: it ends at <|endoftext|> = 151643 only)
QWEN25_GENERATION_CONFIG = {"bos_token_id": 151643, "do_sample": False, "eos_token_id": 151643,
                            "max_new_tokens": 2048, "transformers_version": "4.37.0"}
ENDOFTEXT, IM_END = 151643, 151645
QWEN25_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
QWEN3_ONLY_TOKENS = ("<tool_response>", "</tool_response>", "<think>", "</think>")  # ids 151665-151668


def write_qwen25_tokenizer(qwen3_dir, out) -> None:
    """Qwen2.5 base's tokenizer files in ``out``: the shared BPE files, and Qwen3's tokenizer_config.json
    with what Qwen2.5's differs in: its chat template, eos <|endoftext|>, and no ids 151665-151668."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(qwen3_dir / name, out / name)
    config = json.loads((qwen3_dir / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {i: t for i, t in config["added_tokens_decoder"].items()
                                      if t["content"] not in QWEN3_ONLY_TOKENS}
    config.update(chat_template=QWEN25_CHAT_TEMPLATE, eos_token="<|endoftext|>")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


@pytest.fixture(scope="module")
def qwen25_dir(qwen_tokenizer_dir, tmp_path_factory):
    """A Qwen2.5-3B-shaped base model folder, shrunk: a random 2-layer Qwen2 with Qwen2.5-3B's vocabulary
    (151,936, tied embeddings, bos = eos = 151643), its generation_config.json and its own tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("Qwen2.5-3B-tiny")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                         tie_word_embeddings=True, bos_token_id=ENDOFTEXT, eos_token_id=ENDOFTEXT))
    model.eval().save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(QWEN25_GENERATION_CONFIG, indent=2))
    write_qwen25_tokenizer(qwen_tokenizer_dir, path)
    return path


def _config(data_file, model_dir):
    """configs/paper.py's qwen25_3b PACS setup, shrunk (test_train_real_config.py), on ``model_dir`` with
    the paper config's own data.tokenizer, in one 128-token prompt bucket (the short problems, in the
    Qwen2.5 template with its system prompt), responses of 8 tokens."""
    config = shrunk_paper_config(data_file, "unused", steps=1, arg="qwen25_3b,pacs_beta1", dtype="float32",
                                 remat="full")
    config.data.tokenizer = load_config("paper.py", "qwen25_3b,pacs_beta1").data.tokenizer
    config.model.path = str(model_dir)
    config.rollout.max_new_tokens = 8
    one_prompt_bucket(config, 128).rollout.response_buckets = (8,)
    return config


def test_the_paper_configs_prompt_with_the_models_own_chat_template(qwen25_dir):
    """configs/paper.py leaves data.tokenizer empty: the Qwen2.5 model's own tokenizer, whose template
    puts the default system prompt before the user turn and whose eos is <|endoftext|>."""
    for arg in ("qwen25_3b,pacs_beta1", "qwen25_7b,grpo", "qwen3_8b,ppo"):
        assert load_config("paper.py", arg).data.tokenizer == ""  # data.MODEL_TOKENIZER
    config = load_config("paper.py", "qwen25_3b,pacs_beta1")
    source = data.run_tokenizer(config.data, str(qwen25_dir))
    assert source == str(qwen25_dir)
    tokenizer = data.load_tokenizer(source)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|endoftext|>", ENDOFTEXT)
    assert data.render_prompt(tokenizer, "What is 1 + 1?") == (
        f"{QWEN25_SYSTEM}<|im_start|>user\nWhat is 1 + 1? {data.INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow(seconds=50)
def test_a_qwen25_run_prompts_stops_and_exports_with_its_own_tokenizer(deepscaler_rows, qwen25_dir, tmp_path,
                                                                       monkeypatch):
    """One step of the shrunk qwen25_3b setup on the Qwen2.5 folder, data.tokenizer as the paper config
    has it: the sampler gets prompts in the Qwen2.5 template (the default system prompt first) and
    stops at <|endoftext|> only (the model's generation_config.json, not Qwen3's <|im_end|>); the HF
    export carries the model's tokenizer files, byte for byte, and its generation_config's eos."""
    seen = []
    real_sample = rollout.RolloutCollector.sample

    def recording_sample(self, state, prompts, key, watch=None):
        seen.append((self.programs.sampler.settings.stop_token_ids, [list(p) for p in prompts.prompt_ids]))
        return real_sample(self, state, prompts, key, watch)

    monkeypatch.setattr(rollout.RolloutCollector, "sample", recording_sample)
    config = _config(deepscaler_rows, qwen25_dir)
    _train(config, tmp_path)
    tokenizer = data.load_tokenizer(qwen25_dir)
    assert seen, "the sampler was never called"
    for stops, prompts in seen:
        assert stops == (ENDOFTEXT,)
        for ids in prompts:
            text = tokenizer.decode(ids)
            assert text.startswith(QWEN25_SYSTEM + "<|im_start|>user\n"), text
            assert text.endswith(f"{data.INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"), text

    export = tmp_path / "hf_export"
    for name in ("tokenizer_config.json", "vocab.json", "merges.txt"):
        assert (export / name).read_bytes() == (qwen25_dir / name).read_bytes(), name
    exported = data.load_tokenizer(export)
    assert data.render_prompt(exported, "x").startswith(QWEN25_SYSTEM) and exported.eos_token_id == ENDOFTEXT
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == ENDOFTEXT


def test_a_tokenizer_of_another_family_is_refused_naming_both_unless_forced(deepscaler_rows, qwen25_dir,
                                                                           qwen_tokenizer_dir):
    """The repository's Qwen3 tokenizer with the Qwen2.5 model: refused before anything compiles, naming
    the field, the Qwen3 family (by its <think> token) and the model's Qwen2 / Qwen2.5 family (its
    config.json); data.tokenizer_force=True takes it anyway (its template has no system prompt and ends
    at <|im_end|>)."""
    config = _config(deepscaler_rows, qwen25_dir)
    validate_config(config)  # the model's own
    config.data.tokenizer = str(qwen_tokenizer_dir)
    with pytest.raises(ConfigError) as error:
        validate_config(config)
    message = str(error.value)
    assert message.startswith(f"config.data.tokenizer: {qwen_tokenizer_dir} is a tokenizer of Qwen3 (its added tokens "
                              f"include <think>), but model.path {qwen25_dir} is a Qwen2 / Qwen2.5 model (config.json "
                              f"model_type 'qwen2')"), message
    assert "data.tokenizer_force=True" in message and "Leave data.tokenizer empty" in message, message
    with pytest.raises(data.TokenizerChoiceError, match="is a tokenizer of Qwen3"):  # the trainer's own call
        data.run_tokenizer(config.data, config.model.path)
    config.data.tokenizer_force = True
    validate_config(config)
    forced = data.load_tokenizer(data.run_tokenizer(config.data, config.model.path))
    assert forced.eos_token_id == IM_END and not data.render_prompt(forced, "x").startswith("<|im_start|>system")


def test_the_model_folder_given_by_name_and_a_same_family_tokenizer_are_taken(deepscaler_rows, qwen25_dir,
                                                                               qwen_tokenizer_dir, tmp_path):
    """data.tokenizer naming model.path itself, or a Qwen2.5 tokenizer folder beside it (no config.json:
    its family read from its tokens), is taken; the Qwen3 tokenizer with a Qwen3 model is too."""
    from pacs_jax.data.prompts import model_family, tokenizer_family

    config = _config(deepscaler_rows, qwen25_dir)
    config.data.tokenizer = str(qwen25_dir)
    validate_config(config)
    write_qwen25_tokenizer(qwen_tokenizer_dir, tmp_path / "qwen25_tokenizer")
    assert tokenizer_family(tmp_path / "qwen25_tokenizer") == (
        "qwen2", "its added tokens include <|im_start|> but not <think>")
    config.data.tokenizer = str(tmp_path / "qwen25_tokenizer")
    validate_config(config)
    assert tokenizer_family(qwen25_dir) == ("qwen2", "the model folder's config.json model_type 'qwen2'")
    assert tokenizer_family(qwen_tokenizer_dir)[0] == "qwen3"
    qwen3_model = tmp_path / "qwen3_model"
    qwen3_model.mkdir()
    (qwen3_model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert model_family(qwen3_model) == ("qwen3", "config.json model_type 'qwen3'")
    assert data.run_tokenizer({"tokenizer": str(qwen_tokenizer_dir)}, str(qwen3_model)) == str(qwen_tokenizer_dir)
    with pytest.raises(data.TokenizerChoiceError, match=r"is a tokenizer of Qwen2 / Qwen2\.5 .* is a Qwen3 model"):
        data.run_tokenizer({"tokenizer": str(qwen25_dir)}, str(qwen3_model))


def test_the_models_own_tokenizer_needs_a_model_folder_with_tokenizer_files(deepscaler_rows, qwen25_dir, tmp_path):
    """data.tokenizer "" with a model.path that holds no tokenizer files (a pacs_jax checkpoint, a folder
    of weights only) is refused naming data.tokenizer and what to set; without model.path (random
    weights, which have no tokenizer of their own) it is the repository's Qwen tokenizer."""
    config = _config(deepscaler_rows, qwen25_dir)
    bare = tmp_path / "weights_only"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):  # a model, without tokenizer files
        shutil.copy(qwen25_dir / name, bare / name)
    config.model.path = str(bare)
    with pytest.raises(ConfigError, match=rf"^config\.data\.tokenizer: empty, .* model\.path {bare} has no tokenizer "
                                          r"files \(tokenizer_config\.json"):
        validate_config(config)
    config.model.path = ""  # the shrunk config's random tiny Qwen2
    validate_config(config)
    assert pathlib.Path(data.run_tokenizer(config.data, "")).resolve() == REPO / "data" / "tokenizers" / "qwen3"


def test_the_small_tokenizer_of_the_shrunk_trainings_is_qwens_cut_short(qwen_tokenizer_dir, small_tokenizer_dir,
                                                                          shared_data):
    """conftest.py's small_tokenizer_dir (the shrunk trainings' vocabulary, 4,096 entries): the same chat
    template, the same added tokens in the same order (their ids after the kept merges), the same eos
    (<|im_end|>) and pad (<|endoftext|>), Qwen's family to the trainer, and every text it encodes decodes to
    itself, with Qwen's own tokens where Qwen's are short merges (the byte tokens and the first merges keep
    their ids)."""
    from train_helpers import SMALL_TOKENIZER_SIZE

    real, small = data.load_tokenizer(qwen_tokenizer_dir), data.load_tokenizer(small_tokenizer_dir)
    assert len(small) == SMALL_TOKENIZER_SIZE == 4096
    real_added = {i: t.content for i, t in real.added_tokens_decoder.items()}
    small_added = {i: t.content for i, t in small.added_tokens_decoder.items()}
    assert list(small_added.values()) == list(real_added.values()) and min(small_added) == 4096 - len(real_added)
    assert small.eos_token == real.eos_token == "<|im_end|>" and small.pad_token == real.pad_token == "<|endoftext|>"
    assert data.prompts.tokenizer_family(small_tokenizer_dir)[0] == "qwen3"
    problems = [r["problem"] for r in json.loads((shared_data / "deepscaler_subset" / "math.json").read_text())[:50]]
    for problem in problems:
        text = data.prompts.render_prompt(small, problem)
        assert text == data.prompts.render_prompt(real, problem)
        ids = small(text, add_special_tokens=False)["input_ids"]
        assert small.decode(ids) == text and max(ids) < 4096
        assert ids[0] == small.convert_tokens_to_ids("<|im_start|>") and small.decode(ids[:1]) == "<|im_start|>"
    short = " in the 12 + 7 = 19 and x^2 is"  # Qwen's tokens of it are all among the first merges
    assert max(real(short)["input_ids"]) < 4096 - len(real_added)
    assert small(short)["input_ids"] == real(short)["input_ids"]


def test_a_runtime_without_pytorch_loads_the_tokenizer_without_transformers_advice_about_it():
    """requirements.txt has no PyTorch: transformers then says at import that "Models won't be available",
    which a pacs_jax run never asks of it; the tokenizer loads and nothing is printed."""
    code = "from pacs_jax.data.prompts import load_tokenizer; print(len(load_tokenizer('data/tokenizers/qwen3')))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=without_torch(dict(os.environ)),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (result.stdout, result.stderr) == ("151669\n", ""), result.stderr
