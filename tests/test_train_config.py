"""Training configs: bad values fail before anything compiles with an error naming the field (in
process and through the CLI), and every paper setup of configs/paper.py has docs/design.md section 6.5's
hyper-parameters and validates."""

import ast
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from pacs_jax import data
from pacs_jax.data import deepscaler
from pacs_jax.sharding import config_mesh
from pacs_jax.rl import options_for
from pacs_jax.training.config_check import ConfigError, validate_config
from train_helpers import REPO, load_config, train_env

COMPILE_EVENTS: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *args, **kwargs: COMPILE_EVENTS.append(event) if event.startswith("/jax/core/compile/") else None)


def _set(config: ml_collections.ConfigDict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for name in parents:
        node = node[name]
    node[leaf] = value


def test_default_config_validates_without_a_mesh_and_gives_the_mesh_it_asks_for(monkeypatch):
    config = load_config("default.py")

    def no_mesh(*args, **kwargs):
        raise AssertionError("validate_config built a mesh")

    monkeypatch.setattr(jax, "make_mesh", no_mesh)
    assert validate_config(config) is None
    monkeypatch.undo()
    mesh = config_mesh(config.mesh)
    assert dict(mesh.shape) == {"data": 8, "fsdp": 1, "tensor": 1}  # data=-1 fills the 8 test devices


def test_demo_config_runs_any_objective_with_its_own_options():
    """Each objective runs with its own namespace, algorithm.<objective> (configs/base.py); the others'
    options are not its own (setting one is refused: tests/test_configs.py)."""
    config = load_config("default.py")
    assert options_for(config.algorithm) == dict(config.algorithm.pacs)
    for objective in ("ppo", "grpo", "rloo", "drgrpo"):
        config.algorithm.objective = objective
        validate_config(config)
        assert options_for(config.algorithm) == dict(config.algorithm[objective])


# (field overrides on the demo config, the field the error must name)
BAD_DEMO = {
    "n_1_pacs": ({"rollout.n": 1}, "rollout.n"),
    "n_1_grpo": ({"rollout.n": 1, "algorithm.objective": "grpo"}, "rollout.n"),
    "batch_vs_mesh": ({"mesh.data": 8, "train.prompts_per_step": 3, "rollout.n": 2, "train.mini_batches": 1},
                      "train.prompts_per_step"),
    "micro_batch_vs_mesh": ({"mesh.data": 4, "mesh.fsdp": 2, "train.prompts_per_step": 8, "rollout.n": 4,
                             "train.mini_batches": 2, "train.micro_batches": 4}, "train.prompts_per_step"),
    "mini_batches_split_groups": ({"train.mini_batches": 3}, "train.mini_batches"),
    "micro_batches_split_groups": ({"train.micro_batches": 3}, "train.micro_batches"),
    "unknown_objective": ({"algorithm.objective": "pacz"}, "algorithm.objective"),
    "critic_lr": ({"algorithm.objective": "ppo", "critic.lr": 0.0}, "critic.lr"),
    "critic_lam": ({"algorithm.objective": "ppo", "critic.lam": 1.5}, "critic.lam"),
    "critic_value_clip": ({"algorithm.objective": "ppo", "critic.clip_range_value": 0.0}, "critic.clip_range_value"),
    "critic_loss_scale": ({"algorithm.objective": "ppo", "critic.loss_scale": "sum"}, "critic.loss_scale"),
    "critic_loss_agg_mode": ({"algorithm.objective": "ppo", "critic.loss_agg_mode": "token-sum"},
                             "critic.loss_agg_mode"),
    "critic_verl_micro_batch": ({"algorithm.objective": "ppo", "critic.loss_scale": "verl",
                                 "critic.verl_micro_batch_size": 48}, "critic.verl_micro_batch_size"),
    "critic_path": ({"algorithm.objective": "ppo", "critic.path": "/nonexistent/critic"}, "critic.path"),
    "ppo_unknown_option": ({"algorithm.objective": "ppo", "algorithm.ppo.clip_ratio_d": 3.0}, "algorithm.ppo"),
    "verl_micro_batch_not_dividing": ({"algorithm.objective": "grpo", "algorithm.grpo.loss_scale": "verl",
                                       "algorithm.grpo.verl_micro_batch_size": 48},
                                      "algorithm.grpo.verl_micro_batch_size"),
    "loss_scale": ({"algorithm.objective": "grpo", "algorithm.grpo.loss_scale": "sum"}, "algorithm.grpo.loss_scale"),
    "other_objectives_option": ({"algorithm.grpo.clip_ratio_high": 0.28}, "algorithm.grpo.clip_ratio_high"),
    "stop_token_ids": ({"rollout.stop_token_ids": (3, -1)}, "rollout.stop_token_ids"),
    "reward_mode": ({"reward.mode": "lenient"}, "reward.mode"),
    "max_unscored_fraction": ({"reward.max_unscored_fraction": 1.5}, "reward.max_unscored_fraction"),
    "bad_objective_option": ({"algorithm.pacs.weight_mode": "sometimes"}, "algorithm.pacs.weight_mode"),
    "unknown_objective_option": ({"algorithm.pacs.betta": 1.0}, "algorithm.pacs"),
    "mesh_not_fitting_devices": ({"mesh.data": 16}, "mesh"),
    "mesh_axis_not_dividing": ({"mesh.tensor": 3}, "mesh"),
    "mesh_zero": ({"mesh.fsdp": 0}, "mesh.fsdp"),
    "zero_steps": ({"train.steps": 0}, "train.steps"),
    "greedy_rollout": ({"rollout.temperature": 0.0}, "rollout.temperature"),
    "top_p": ({"rollout.top_p": 1.5}, "rollout.top_p"),
    "max_logprob_diff": ({"rollout.max_logprob_diff": -1.0}, "rollout.max_logprob_diff"),
    "page_size": ({"rollout.sampler": "paged", "rollout.page_size": 0}, "rollout.page_size"),
    "pages_below_one_response": ({"rollout.sampler": "paged", "rollout.pages": 1}, "rollout.pages"),
    "schedule": ({"optim.schedule": "cosin"}, "optim.schedule"),
    "negative_lr": ({"optim.lr": -1e-6}, "optim.lr"),
    "reward": ({"reward.name": "maths"}, "reward.name"),
    "remat": ({"model.remat": "most"}, "model.remat"),
    "dtype": ({"model.dtype": "int8"}, "model.dtype"),
    "eval_set": ({"eval.sets": "math_501"}, "eval.sets"),
    "model_path": ({"model.path": "/nonexistent/model"}, "model.path"),
    "data_source": ({"data.source": "arithmetics"}, "data.source"),
    "files_source_without_files": ({"data.source": "files"}, "data.train_files"),
    "held_out_set_without_held_out": ({"data.held_out_problems": 0}, "eval.sets"),
    "arithmetic_problems": ({"data.arithmetic.problems": 0}, "data.arithmetic.problems"),
    "warmstart_problems_leave_rl_none": ({"data.warmstart_problems": 2200}, "data.warmstart_problems"),
    "warmstart_problems_without_warmstart": ({"warmstart.steps": 0}, "data.warmstart_problems"),
    "tokenizer": ({"data.tokenizer": "/nonexistent/tokenizer"}, "data.tokenizer"),
    "warmstart_response_template": ({"warmstart.response": "\\boxed{{{ans}}}"}, "warmstart.response"),
    "warmstart_response_too_long": ({"warmstart.max_response_tokens": 10}, "warmstart.max_response_tokens"),
    "warmstart_target": ({"warmstart.target_accuracy": 1.5}, "warmstart.target_accuracy"),
    "warmstart_lr": ({"warmstart.lr": 0.0}, "warmstart.lr"),
    "greedy_eval_with_n": ({"eval.periodic.n": 4}, "eval.periodic.n"),
    "eval_final_top_p": ({"eval.final.top_p": 0.0}, "eval.final.top_p"),
    "eval_every": ({"eval.periodic.every": -5}, "eval.periodic.every"),
}


@pytest.mark.parametrize("case", sorted(BAD_DEMO))
def test_bad_demo_config_names_the_field_before_compiling(case):
    overrides, field = BAD_DEMO[case]
    config = load_config("default.py")
    for dotted, value in overrides.items():
        _set(config, dotted, value)
    before = len(COMPILE_EVENTS)
    with pytest.raises(ConfigError) as error:
        validate_config(config)
    assert str(error.value).startswith(f"config.{field}"), str(error.value)
    assert len(COMPILE_EVENTS) == before  # nothing was traced or compiled
    jax.jit(lambda x: x + 1)(jnp.float32(len(case)))  # ... which this listener would have seen
    assert len(COMPILE_EVENTS) > before


@pytest.fixture
def in_repo(monkeypatch, shared_data):
    """Run from the repository root, where the paper configs' data/ paths point."""
    monkeypatch.chdir(REPO)
    return shared_data


def _paper(model: str, algo: str, tokenizer) -> ml_collections.ConfigDict:
    """A paper setup on 8 devices, training on the subset in the repository (the configs point at the
    full set, which tools/prepare_data.py downloads). The tests pass conftest.py's small_tokenizer_dir (Qwen's
    tokenizer cut to 4,096 entries, Qwen3's family as the repository's): they are about the config's fields, and
    loading the real 151,669-entry one was most of each validation (0.35 s of CPU, against 0.01)."""
    config = load_config("paper.py", f"{model},{algo}")
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2  # the paper's slice, shrunk to 8 devices
    config.data.tokenizer = str(tokenizer)
    config.data.train_files = deepscaler.SUBSET_FILES
    config.model.random_init = True  # no released weights here; a real run passes model.path (test below)
    return config


PRESET_OF = {"qwen25_3b": "Qwen2.5-3B", "qwen25_7b": "Qwen2.5-7B", "qwen3_4b": "Qwen3-4B", "qwen3_8b": "Qwen3-8B",
             "qwen25_7b_v6e": "Qwen2.5-7B"}


@pytest.mark.parametrize("model", sorted(PRESET_OF))
def test_paper_config_without_model_path_is_refused_unless_random_init_is_asked_for(in_repo, small_tokenizer_dir,
                                                                                    tmp_path, model):
    """Issue 28 item 3: a paper config whose model.path was forgotten would train its preset from random
    weights; validate_config refuses it naming model.path and how to ask for random weights by name."""
    config = _paper(model, "pacs_beta1", small_tokenizer_dir)
    config.model.random_init = False  # as configs/paper.py has it
    with pytest.raises(ConfigError, match=rf"^config\.model\.path: not set: the {re.escape(PRESET_OF[model])} "
                                          r"preset would train from random weights; .*--config\.model\.random_init=True"):
        validate_config(config)
    config.model.random_init = True  # asked for by name
    validate_config(config)
    config.model.path = str(tmp_path)
    with pytest.raises(ConfigError, match=r"^config\.model\.random_init: True, but model\.path="):
        validate_config(config)
    config.model.random_init = False  # then the folder is read (issue 35): an empty one is no model
    with pytest.raises(ConfigError, match=rf"^config\.model\.path: {re.escape(str(tmp_path))}: not a model: no "
                                          r"config\.json"):
        validate_config(config)


def test_architecture_fields_without_a_preset_still_initialise_at_random(in_repo, small_tokenizer_dir):
    """The tests' shrunk paper configs (preset "", every architecture field named) and the demo are
    random initialisations asked for field by field: no model.path needed."""
    config = _paper("qwen25_3b", "pacs_beta1", small_tokenizer_dir)
    config.model.random_init = False
    config.model.preset = ""
    with pytest.raises(ConfigError, match=r"^config\.model\.model_type: '' is not one of .*or set model\.path or "
                                          r"model\.preset"):
        validate_config(config)  # configs/base.py leaves the architecture to model.path / model.preset
    config.model.update(model_type="qwen2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
    with pytest.raises(ConfigError, match=r"^config\.model\.num_hidden_layers: must be > 0 without model\.path"):
        validate_config(config)
    config.model.num_hidden_layers = 2
    validate_config(config)
    validate_config(load_config("default.py"))


@pytest.mark.parametrize("algo", ["pacs_beta1", "ppo"])
def test_paper_config_trains_on_the_full_set_and_says_how_to_make_it(in_repo, small_tokenizer_dir, tmp_path, algo):
    """configs/paper.py reads tools/prepare_data.py's default output; while it is missing, validate_config
    names the field, the file and the command that makes it (here on a copy of the path under tmp_path, so
    that a downloaded set in the checkout does not hide the error)."""
    written = load_config("paper.py", f"qwen3_4b,{algo}").data.train_files
    assert tuple(written) == (deepscaler.DEFAULT_TRAIN_FILE,) == ("data/deepscaler/train.jsonl",)
    config = _paper("qwen3_4b", algo, small_tokenizer_dir)
    missing = tmp_path / deepscaler.DEFAULT_TRAIN_FILE
    config.data.train_files = (str(missing),)
    with pytest.raises(ConfigError) as error:
        validate_config(config)
    message = str(error.value)
    assert message.startswith(f"config.data.train_files[0]: {missing} does not exist; "), message
    assert f"python tools/prepare_data.py deepscaler --out {missing.parent}" in message, message
    assert "data/deepscaler_subset/math.json" in message, message
    if not (REPO / deepscaler.DEFAULT_TRAIN_FILE).exists():  # the config as written, in a checkout without the set
        config.data.train_files = written
        with pytest.raises(ConfigError, match=r"^config\.data\.train_files\[0\]: data/deepscaler/train\.jsonl does "
                                              r"not exist; .*`python tools/prepare_data\.py deepscaler --out "
                                              r"data/deepscaler`"):
            validate_config(config)


@pytest.mark.parametrize("field, value, index", [("data.train_files", ("data/nonexistent.json",), 0),
                                                 ("data.train_files", ("data/deepscaler_subset/math.json",
                                                                       "data/no_such_dir/aime.json"), 1)])
def test_missing_dataset_path_names_the_entry(in_repo, small_tokenizer_dir, field, value, index):
    config = _paper("qwen3_4b", "pacs_beta1", small_tokenizer_dir)
    _set(config, field, value)
    with pytest.raises(ConfigError, match=rf"^config\.data\.train_files\[{index}\]: .*{value[index].split('/')[-1]}"):
        validate_config(config)


def test_missing_tokenizer_and_unknown_preset_name_their_fields(in_repo, small_tokenizer_dir):
    config = _paper("qwen3_4b", "grpo", small_tokenizer_dir)
    config.data.tokenizer = "/nonexistent/tokenizer"
    with pytest.raises(ConfigError, match=r"^config\.data\.tokenizer: "):
        validate_config(config)
    config = _paper("qwen3_4b", "grpo", small_tokenizer_dir)
    config.model.preset = "Qwen9-1T"
    with pytest.raises(ConfigError, match=r"^config\.model\.preset: 'Qwen9-1T'"):
        validate_config(config)


# docs/design.md section 6.5 (the paper's setup), written out here rather than read from the code.
PAPER_MODELS = {"qwen25_3b": "Qwen2.5-3B", "qwen25_7b": "Qwen2.5-7B", "qwen3_4b": "Qwen3-4B", "qwen3_8b": "Qwen3-8B"}
PAPER_ALGOS = {
    "pacs_beta1": ("pacs", dict(beta=1.0, use_weight=True, weight_mode="question", reward_method="1",
                                adv_estimator="rloo")),
    "pacs_beta2": ("pacs", dict(beta=2.0, use_weight=True, weight_mode="question", reward_method="1",
                                adv_estimator="rloo")),
    "pacs_beta1_noweight": ("pacs", dict(beta=1.0, use_weight=False, weight_mode="question", reward_method="1",
                                         adv_estimator="rloo")),
    "pacs_beta2_noweight": ("pacs", dict(beta=2.0, use_weight=False, weight_mode="question", reward_method="1",
                                         adv_estimator="rloo")),
    # verl 0.3.1's scale as the authors ran it: ppo_micro_batch_size_per_gpu=8, max_response_length=4096
    "grpo": ("grpo", dict(loss_agg_mode="seq-mean-token-sum-norm", clip_ratio_low=0.2, clip_ratio_high=0.2,
                          clip_ratio_c=3.0, loss_scale="verl", verl_micro_batch_size=8, norm_length=4096)),
    # the authors' scripts/baseline/ppo.sh: the actor as GRPO's, a critic with lr 1e-5 and micro-batches of 8
    "ppo": ("ppo", dict(loss_agg_mode="seq-mean-token-sum-norm", clip_ratio_low=0.2, clip_ratio_high=0.2,
                        clip_ratio_c=3.0, loss_scale="verl", verl_micro_batch_size=8, norm_length=4096)),
}
# the authors' configs/ppo_trainer.yaml (critic and GAE; critic.loss_agg_mode: the actor's), critic.optim.lr and
# critic.ppo_micro_batch_size_per_gpu of ppo.sh
PAPER_CRITIC = dict(path="", lr=1e-5, b1=0.9, b2=0.999, weight_decay=0.01, grad_clip=1.0, clip_range_value=0.5,
                    gamma=1.0, lam=1.0, loss_agg_mode="actor", loss_scale="verl", verl_micro_batch_size=8)


@pytest.mark.parametrize("algo", sorted(PAPER_ALGOS))
@pytest.mark.parametrize("model", sorted(PAPER_MODELS))
def test_paper_config_has_section_6_values_and_validates(in_repo, small_tokenizer_dir, model, algo):
    config = _paper(model, algo, small_tokenizer_dir)
    objective, options = PAPER_ALGOS[algo]
    assert (config.data.source, config.data.held_out_problems, config.warmstart.steps) == ("files", 0, 0)
    assert config.data.instruction == data.INSTRUCTION
    assert config.model.preset == PAPER_MODELS[model] and config.model.path == ""
    assert config.model.param_dtype == "float32"  # fp32 master weights
    assert config.algorithm.objective == objective
    assert options_for(config.algorithm) == options
    assert (config.optim.lr, config.optim.schedule, config.optim.warmup_steps) == (1e-6, "constant", 0)
    assert (config.optim.b1, config.optim.b2, config.optim.weight_decay) == (0.9, 0.999, 0.01)
    assert config.optim.grad_clip == (0.0 if objective == "pacs" else 1.0)
    if objective == "ppo":
        assert dict(config.critic) == PAPER_CRITIC
    assert (config.train.prompts_per_step, config.train.mini_batches, config.train.steps) == (1024, 4, 300)
    rollout = config.rollout
    assert (rollout.n, rollout.temperature, rollout.top_p, rollout.top_k) == (8, 1.0, 1.0, 0)
    assert (config.rollout.max_new_tokens, config.data.max_prompt_length) == (4096, 512)
    # the authors' evaluation: greedy every 5 steps on the test sets with GSM8K; final inference N=32 at T=0.6
    assert config.eval.sets.split(",") == ["math_500", "aime_2024", "aime_2025", "amc23", "gsm8k"]
    assert dict(config.eval.periodic) == dict(every=5, n=1, temperature=0.0, top_p=1.0)
    assert (config.eval.final.n, config.eval.final.temperature, config.eval.max_new_tokens) == (32, 0.6, 4096)
    assert config.reward.name == "math"

    validate_config(config)
    mesh = config_mesh(config.mesh)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}


def test_configs_is_a_package_and_its_files_load_by_path_alike():
    import configs.paper

    by_import = configs.paper.get_config("qwen3_4b,grpo")
    by_path = load_config("paper.py", "qwen3_4b,grpo")
    assert by_import.to_dict() == by_path.to_dict()
    assert by_import.algorithm.objective == "grpo" and by_import.model.preset == "Qwen3-4B"


def test_paper_config_refuses_unknown_names():
    with pytest.raises(ValueError, match="qwen9"):
        load_config("paper.py", "qwen9,pacs_beta1")
    with pytest.raises(ValueError, match="pacs_beta3"):
        load_config("paper.py", "qwen3_4b,pacs_beta3")


# Through the CLI: (flags, env with the 8 test devices?, text the error must show)
BAD_CLI = {
    "unknown_key": (("--config.train.stepz=1",), False, ("--config.train.stepz", "did you mean --config.train.steps?")),
    "n_1": (("--config.rollout.n=1",), False, ("config.rollout.n: pacs", "n >= 2")),
    "batch_vs_mesh": (("--config.train.prompts_per_step=3", "--config.rollout.n=2", "--config.train.mini_batches=1"),
                      True, ("config.train.prompts_per_step:", "data x fsdp = 8")),
    "missing_dataset": (("--config=configs/paper.py:qwen3_4b,pacs_beta1",
                         "--config.data.train_files=('data/nonexistent.json',)"), False,
                        ("config.data.train_files[0]:", "nonexistent.json does not exist")),
    "unknown_objective": (("--config.algorithm.objective=pacz",), False, ("config.algorithm.objective: 'pacz'",)),
}


@pytest.mark.slow
def test_bad_configs_fail_in_the_cli_before_compiling(tmp_path):
    """All CLI cases at once (each is a Python start-up); JAX logs every compilation to stderr."""
    processes = {}
    for case, (flags, eight_devices, _) in {**BAD_CLI, "control": (
            ("--config.warmstart.response=#{answer}",), False, ())}.items():
        env = train_env()
        if eight_devices:
            env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
        env["JAX_LOG_COMPILES"] = "1"
        processes[case] = subprocess.Popen(
            [sys.executable, "-m", "pacs_jax.train", f"--workdir={tmp_path / case}", *flags], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    for case, process in processes.items():
        stdout, stderr = process.communicate(timeout=300)
        results[case] = (process.returncode, stderr)

    # the control passes validation, compiles the model's initialisation, then fails in the warm-start
    # (its target response has a character the tokenizer lacks): proof that compilations would show
    code, stderr = results.pop("control")
    assert code != 0 and "Compiling" in stderr, stderr[-3000:]
    for case, (code, stderr) in results.items():
        assert code != 0, case
        for text in BAD_CLI[case][2]:
            assert text in stderr, f"{case}: {text!r} not in\n{stderr[-3000:]}"
        assert "Compiling" not in stderr, case
        assert not (tmp_path / case).exists(), f"{case}: the workdir was created"


def _leaf_fields(tree: dict, prefix: str = ""):
    """Dotted paths of a config's leaves; dict-valued fields handed on whole (options, set files) are leaves."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and not re.fullmatch(r"algorithm\.\w+|eval\.set_files", path):
            yield from _leaf_fields(value, path + ".")
        else:
            yield path


def _names_in_code(path) -> set[str]:
    """Attribute names and string constants of a module's code (comments and docstrings left out)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names.update(re.findall(r"\w+", node.value))
    return names


def test_every_config_field_is_read_by_the_package():
    """A field no module of pacs_jax names in its code (as ``.field`` or in a string; comments and
    docstrings do not count) is one nothing reads."""
    names = set().union(*(_names_in_code(p) for p in (REPO / "pacs_jax").rglob("*.py")))
    unread = set()
    for config in (load_config("default.py"), load_config("paper.py", "qwen25_7b,ppo")):
        unread.update(path for path in _leaf_fields(config.to_dict()) if path.rsplit(".", 1)[-1] not in names)
    assert not unread, f"config fields nothing reads: {sorted(unread)}"
