"""What the rollout correction costs a training step, in one process.

    python tools/bench_rollout_correction.py                                   # the demo, correction token_tis
    python tools/bench_rollout_correction.py --preset=seq_mis --rounds=3 --steps=8 --config=... # any trainer config

Runs the config's RL steps (no warm-start, no evaluation, no checkpoints) with the correction off and with
``algorithm.rollout_correction.preset`` on, alternating ``--rounds`` times (``--steps`` steps each, the
first of each run not counted: it waits for the compilations), each config's programs compiled once.
Prints the mean step time of each, their ratio (on / off), and the correction program alone (its
median over 20 calls on one step's update batch) against the step.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import tempfile
import time

from absl import app, flags
from ml_collections import config_flags

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
_CONFIG = config_flags.DEFINE_config_file("config", str(REPO / "configs" / "default.py"),
                                          "trainer config (as for python -m pacs_jax.train)", lock_config=False)
_PRESET = flags.DEFINE_string("preset", "token_tis", "algorithm.rollout_correction.preset of the corrected runs")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "off / on pairs of runs")
_STEPS = flags.DEFINE_integer("steps", 8, "RL steps a run (the first is not counted)")


def main(argv) -> None:
    import jax
    import numpy as np
    from flax import nnx

    from pacs_jax import console, data, evaluation
    from pacs_jax.rewards import RewardPool
    from pacs_jax.sharding import config_mesh
    from pacs_jax.training.config_check import placed
    from pacs_jax.training.loop import rl_train
    from pacs_jax.training.run import build_model, prompt_source
    from pacs_jax.training.spec import RunSpec
    from pacs_jax.training.step_programs import StepPrograms

    console.setup()

    def spec_of(preset: str):
        config = _CONFIG.value.copy_and_resolve_references()
        config.algorithm.rollout_correction.preset = preset
        config.warmstart.steps = config.data.warmstart_problems = 0
        config.eval.sets = ""
        spec = RunSpec.unplaced(config)
        return placed(dataclasses.replace(spec, train=dataclasses.replace(spec.train, steps=_STEPS.value,
                                                                          checkpoint_every=0)))

    specs = {"off": spec_of(""), "on": spec_of(_PRESET.value)}
    jax.set_mesh(config_mesh(_CONFIG.value.mesh))
    tokenizer = data.load_tokenizer(data.run_tokenizer(dataclasses.asdict(specs["off"].data), specs["off"].model.path))
    model = build_model(specs["off"], tokenizer)
    stop_ids = evaluation.default_stop_ids(model, tokenizer)
    graphdef, params = nnx.split(model)
    programs = {name: StepPrograms(spec, graphdef, params, stop_ids) for name, spec in specs.items()}
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    times = {"off": [], "on": []}
    with RewardPool(specs["off"].reward.workers or None, specs["off"].reward.item_timeout) as pool:
        for _ in range(_ROUNDS.value):
            for name, spec in specs.items():
                prompts, *_ = prompt_source(spec, tokenizer)
                with tempfile.TemporaryDirectory() as workdir:
                    result = rl_train(spec, workdir, nnx.merge(graphdef, jax.tree.map(jax.numpy.copy, params)),
                                      prompts, decode=decode, stop_token_ids=stop_ids, reward_pool=pool,
                                      programs=programs[name])
                times[name] += [h["time_step"] for h in result.history[1:]]
                if name == "on":
                    sampled = result.collector.sample(params, prompts.next_batch(), jax.random.key(0))
                    batch, *_ = result.collector.old_policy(params, sampled)
                    correct = programs["on"].learner.rollout_correction
                    args = (sampled.sampler_logprobs, batch.old_logp, batch.response_mask)
                    jax.block_until_ready(correct(*args))
                    calls = []
                    for _ in range(20):
                        t0 = time.perf_counter()
                        jax.block_until_ready(correct(*args))
                        calls.append(time.perf_counter() - t0)
    from device_rates import device_line

    off, on = float(np.mean(times["off"])), float(np.mean(times["on"]))
    program = float(np.median(calls))
    print(f"\n{device_line()}")
    print(f"{_CONFIG.value.train.prompts_per_step} prompts x {_CONFIG.value.rollout.n} responses a step, "
          f"{_ROUNDS.value} rounds x {_STEPS.value - 1} timed steps each")
    print(f"step, correction off:            {off * 1e3:9.1f} ms (sd {np.std(times['off']) * 1e3:.1f})")
    print(f"step, correction {_PRESET.value + ':':<14}{on * 1e3:9.1f} ms (sd {np.std(times['on']) * 1e3:.1f})")
    print(f"on / off: {on / off:.3f}; the correction program alone {program * 1e3:.2f} ms = {program / off:.2%} of a step")


if __name__ == "__main__":
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
    app.run(main, argv=sys.argv)
