"""The config schema (configs/base.py): every option of every objective is a command-line override on
the demo and the paper configs, one the chosen objective does not read is refused naming it, and
config.json records the options that ran and the model the run builds."""

import json

import pytest
from absl import flags
from ml_collections import config_flags

from pacs_jax import models, rl
from pacs_jax.data import deepscaler
from pacs_jax.training.config_check import ConfigError, validate_config
from pacs_jax.training.spec import RunSpec
from pacs_jax.training.workdir import recorded_config, write_config
from test_cli_errors import _error_line, _run
from train_helpers import REPO


def _parse(*argv: str):
    """The config as the trainer's flag parsing (config_flags) makes it from ``argv``."""
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=["train", *argv])
    values(["train", *argv])
    return values.config


def _other_value(spec: rl.ObjectiveSpec, option: str, default):
    """A valid value of ``option`` other than its default (verl's micro-batch size 8 divides every
    config's update micro-batch here); the default itself where it is the only choice (GSPO's aggregation)."""
    if option in spec.choices:
        return next((choice for choice in spec.choices[option] if choice != str(default)), default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, float):
        return default + 0.5
    return 8  # int options, and norm_length (None: the padded width)


# (config file, overrides that make it valid on the 8 test devices without released weights or the full set)
CONFIGS = {
    "demo": (str(REPO / "configs" / "default.py"), ()),
    "paper": (str(REPO / "configs" / "paper.py") + ":qwen25_7b,pacs_beta1",
              ("--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
               "--config.model.random_init=True", f"--config.data.train_files={deepscaler.SUBSET_FILES!r}")),
}


@pytest.mark.parametrize("objective", sorted(rl.OBJECTIVES))
@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_every_option_of_every_objective_is_a_command_line_override(which, objective, qwen_tokenizer_dir,
                                                                     monkeypatch):
    monkeypatch.chdir(REPO)
    file, fixed = CONFIGS[which]
    spec = rl.OBJECTIVES[objective]
    wanted = {option: _other_value(spec, option, default) for option, default in spec.defaults.items()}
    tokenizer = (f"--config.data.tokenizer={qwen_tokenizer_dir}",) if which == "paper" else ()
    config = _parse(f"--config={file}", *fixed, *tokenizer, f"--config.algorithm.objective={objective}",
                    *(f"--config.algorithm.{objective}.{option}={value}" for option, value in wanted.items()))
    assert rl.options_for(config.algorithm) == wanted
    validate_config(config)


def test_an_option_of_an_objective_that_does_not_run_is_refused_naming_it():
    config = _parse(f"--config={REPO / 'configs' / 'default.py'}", "--config.algorithm.objective=grpo",
                    "--config.algorithm.pacs.beta=2")
    with pytest.raises(ConfigError) as error:
        validate_config(config)
    assert str(error.value) == ("config.algorithm.pacs.beta: 2.0 is set, but algorithm.objective is 'grpo', which "
                                "does not read algorithm.pacs ('grpo' takes no option 'beta')")
    config = _parse(f"--config={REPO / 'configs' / 'paper.py'}:qwen25_7b,ppo",
                    "--config.algorithm.grpo.clip_ratio_high=0.28")
    with pytest.raises(ConfigError, match=r"^config\.algorithm\.grpo\.clip_ratio_high: 0\.28 is set, but "
                                          r"algorithm\.objective is 'ppo', .*\(set algorithm\.ppo\.clip_ratio_high\)$"):
        validate_config(config)
    with pytest.raises(KeyError, match="options"):  # one namespace per objective: no shared "options"
        _parse(f"--config={REPO / 'configs' / 'default.py'}", "--config.algorithm.options.beta=2")


def test_the_trainer_refuses_another_objectives_option_in_one_line(tmp_path):
    line = _error_line(_run("pacs_jax.train", f"--workdir={tmp_path / 'run'}", "--config.algorithm.objective=rloo",
                            "--config.algorithm.pacs.use_weight=False"), "pacs_jax.train")
    assert line == ("pacs_jax.train: error: config.algorithm.pacs.use_weight: False is set, but algorithm.objective "
                    "is 'rloo', which does not read algorithm.pacs ('rloo' takes no option 'use_weight')")
    assert not (tmp_path / "run").exists()


def test_config_json_records_the_paper_model_and_the_options_that_ran(tmp_path):
    """configs/base.py leaves the architecture to the preset; config.json records the Qwen2.5-7B the
    run builds (training/run.py writes it with the model it plans; a shrunk paper run's config.json:
    test_train_real_config.py), not empty fields."""
    config = _parse(f"--config={REPO / 'configs' / 'paper.py'}:qwen25_7b,grpo", "--config.model.random_init=True")
    assert (config.model.model_type, config.model.hidden_size, config.model.num_hidden_layers) == ("", 0, 0)
    qwen25_7b = models.preset(config.model.preset)  # what the run builds (training/run.py: _planned_model)
    write_config(config, tmp_path, qwen25_7b)
    recorded = json.loads((tmp_path / "config.json").read_text())
    assert recorded["model"]["preset"] == "Qwen2.5-7B"
    assert {k: recorded["model"][k] for k in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                                               "num_attention_heads", "num_key_value_heads", "vocab_size")} == \
        dict(model_type="qwen2", hidden_size=qwen25_7b.hidden_size, intermediate_size=qwen25_7b.intermediate_size,
             num_hidden_layers=28, num_attention_heads=qwen25_7b.num_attention_heads,
             num_key_value_heads=qwen25_7b.num_key_value_heads, vocab_size=qwen25_7b.vocab_size)
    assert recorded["model"]["hidden_size"] == 3584
    assert recorded["algorithm"] == {"objective": "grpo", "options": dict(
        loss_agg_mode="seq-mean-token-sum-norm", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
        norm_length=4096, loss_scale="verl", verl_micro_batch_size=8)}
    # a model not known before loading it: the fields as configured
    assert recorded_config(config, None)["model"]["hidden_size"] == 0


def test_every_paper_algo_is_a_command_line_config_that_validates(qwen_tokenizer_dir, monkeypatch):
    """Each ALGO of configs/paper.py (the tables' rows, the paper's ablations, the authors' other options) is
    a ``--config=configs/paper.py:MODEL,ALGO`` the trainer's flag parsing loads and validate_config accepts, and
    its workdir is named after it; an unknown ALGO is refused naming the known ones."""
    import configs.paper

    monkeypatch.chdir(REPO)
    file, fixed = CONFIGS["paper"]
    for algo in configs.paper.ALGORITHMS:
        config = _parse(f"--config={file.rsplit(':', 1)[0]}:qwen25_7b,{algo}", *fixed,
                        f"--config.data.tokenizer={qwen_tokenizer_dir}")
        assert config.workdir == f"workdir/qwen25_7b_{algo}"
        validate_config(config)
    with pytest.raises(ValueError, match=r"pacs_beta0p5.*pacs_beta1_drgrpo_adv"):
        configs.paper.get_config("qwen25_7b,pacs_beta3")


def test_carry_over_is_one_flag_on_a_paper_config_and_the_run_and_its_record_agree_on_its_tail():
    """configs/paper.py leaves rollout.tail_slots to the mode (None): a call's tail narrows to slots / 8, and
    with --config.rollout.carry_over=True alone (its calls end before their tail) to nothing. The spec (what
    the trainer, check_config and the plan tools read) and config.json hold the same value; a tail set on the
    command line is taken as set, and beside carry-over refused in one line naming it (it would be dropped)."""
    file = f"--config={REPO / 'configs' / 'paper.py'}:qwen25_7b,pacs_beta1"
    for flags_, tail in (((), 4096 // 8), (("--config.rollout.carry_over=True",), 0),
                         (("--config.rollout.tail_slots=256",), 256)):
        config = _parse(file, *flags_)
        spec = RunSpec.unplaced(config)
        assert spec.rollout.sampler.tail_slots == tail, flags_
        assert recorded_config(config, None)["rollout"]["tail_slots"] == tail, flags_
    config = _parse(file, "--config.rollout.carry_over=True", "--config.rollout.tail_slots=256")
    with pytest.raises(ConfigError) as error:
        RunSpec.unplaced(config)
    assert str(error.value) == ("config.rollout.carry_over: a call ends before its tail, so it never narrows: set "
                                "rollout.tail_slots=0, or None (the mode's, as the paper configs leave it; it is 256)")
