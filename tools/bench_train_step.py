"""The trainer's step time against the sum of its parts, in one process.

    python tools/bench_train_step.py --config=configs/paper.py:qwen25_3b,pacs_beta1 \\
        --config.model.preset= --config.model.hidden_size=256 ...     # any trainer config and overrides

Runs ``--steps`` (default 3) real training steps of the config (real prompts, real reward; no
checkpoints, no evaluation), then times the same compiled programs alone, back to back on the
prompts of one more step: the sampler (``RolloutCollector.sample``, ids to the host included), the
pi_old pass and the update (every mini-batch's optimizer step). Prints the trainer's per-phase
times (mean over the steps after the first) beside the parts and the ratio

    step / (sample + pi_old + update)

which is what the loop's own work costs on top: host glue, reward scoring not hidden behind pi_old,
synchronisation, recompilation (the compilation count after the first step is printed too).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import tempfile
import time

from absl import app, flags
from ml_collections import config_flags

REPO = pathlib.Path(__file__).resolve().parents[1]
_CONFIG = config_flags.DEFINE_config_file("config", str(REPO / "configs" / "paper.py") + ":qwen25_3b,pacs_beta1",
                                          "trainer config (as for python -m pacs_jax.train)", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 3, "training steps (the first one is not averaged)")
_JSON = flags.DEFINE_string("json", None, "also write the results to this JSON file")


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv) -> None:
    import jax
    import numpy as np
    from flax import nnx

    from pacs_jax import data, evaluation
    from pacs_jax.rewards import RewardPool
    from pacs_jax.sharding import config_mesh
    from pacs_jax.training.config_check import placed
    from pacs_jax.training.loop import rl_train
    from pacs_jax.training.run import build_model, prompt_source
    from pacs_jax.training.spec import RunSpec

    config = _CONFIG.value
    spec = RunSpec.unplaced(config)
    spec = placed(dataclasses.replace(
        spec, train=dataclasses.replace(spec.train, steps=_STEPS.value, checkpoint_every=0),
        eval=dataclasses.replace(spec.eval, sets=())))
    jax.set_mesh(config_mesh(config.mesh))  # for the rest of this process, as the trainer's CLI sets it
    tokenizer = data.load_tokenizer(data.run_tokenizer(dataclasses.asdict(spec.data), spec.model.path))
    model = build_model(spec, tokenizer)
    prompts, _, _, _ = prompt_source(spec, tokenizer)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as workdir, \
            RewardPool(spec.reward.workers or None, spec.reward.item_timeout) as pool:
        result = rl_train(spec, workdir, model, prompts, decode=decode,
                          stop_token_ids=evaluation.default_stop_ids(model, tokenizer), reward_pool=pool)
    for row in result.history:
        print(json.dumps({k: round(v, 4) for k, v in row.items() if k.startswith("time_") or k in
                          ("step", "compilations", "tokens_per_second", "response_length_mean")}), flush=True)
    later = result.history[1:] or result.history
    trainer = {k: float(np.mean([h[k] for h in later]))
               for k in ("time_step", "time_sample", "time_reward", "time_old_logprob", "time_update")}

    # The parts alone: the same compiled programs, back to back, on one more step's prompts.
    collector, update = result.collector, result.programs.learner.update
    _, params = nnx.split(result.model)
    key = jax.random.key(1)
    batch_prompts = prompts.next_batch()
    collector.sample(params, batch_prompts, key)  # warm (same bucket as the timed call)
    sampled, t_sample = _timed(lambda: collector.sample(params, batch_prompts, key))
    (batch, *_), t_old = _timed(lambda: jax.block_until_ready(collector.old_policy(params, sampled)))
    rows = sampled.tokens.shape[0]
    batch = batch.replace(rewards=collector._put(np.tile([1.0, 0.0], rows // 2).astype(np.float32)))
    # the trained state is donated to this last update (no second copy of params + optimizer state)
    _, t_update = _timed(lambda: jax.block_until_ready(update(params, result.opt_state, batch)))
    parts = {"sample": t_sample, "old_logprob": t_old, "update": t_update}
    total = sum(parts.values())
    ratio = trainer["time_step"] / total
    compiled = [h["compilations"] for h in result.history]

    from device_rates import device_line, rates_line

    print(f"\n{device_line()}; {rates_line((config.model.dtype,))}")
    print(f"model "
          f"{config.model.preset or 'custom'} ({config.model.dtype}, remat {config.model.remat}), "
          f"{config.train.prompts_per_step} prompts x {config.rollout.n}, max {config.rollout.max_new_tokens} new tokens")
    print(f"{'phase':<14}{'trainer step (s)':>18}{'part alone (s)':>16}")
    for name, part in (("sample", "sample"), ("old_logprob", "old_logprob"), ("update", "update")):
        print(f"{name:<14}{trainer['time_' + name]:>18.3f}{parts[part]:>16.3f}")
    print(f"{'reward':<14}{trainer['time_reward']:>18.3f}{'(host, overlaps pi_old)':>26}")
    print(f"{'step':<14}{trainer['time_step']:>18.3f}{total:>16.3f}")
    print(f"step / sum of parts: {ratio:.2f}   compilations after each step: {compiled}")
    if _JSON.value:
        pathlib.Path(_JSON.value).write_text(json.dumps(
            {"trainer": trainer, "parts": parts, "ratio": ratio, "compilations": compiled}, indent=2))


if __name__ == "__main__":
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
    app.run(main, argv=sys.argv)
