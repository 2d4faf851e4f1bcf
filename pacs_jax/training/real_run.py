"""Training on real math data with a Hugging Face tokenizer (every config but the demo).

model (HF dir / checkpoint, or a preset at random init) -> grain prompt pipeline over
data.train_files -> rl_train with periodic evaluation (pass@k on config.eval.sets) -> HF export.
"""

from __future__ import annotations

import os

import jax
import ml_collections
from etils import epath
from jax.sharding import Mesh

from pacs_jax import checkpoints, data, evaluation, models
from pacs_jax.rewards import RewardPool
from pacs_jax.training import memory_plan
from pacs_jax.training.loop import rl_train
from pacs_jax.training.rollout import PromptBatch


class GrainPromptSource:
    """Adapts the grain prompt iterator (pacs_jax.data.pipeline) to the trainer's PromptSource."""

    def __init__(self, examples: list[data.PromptExample], batch_size: int, seed: int):
        self.examples = examples
        self.config = data.PipelineConfig(batch_size=batch_size, seed=seed, num_epochs=None)
        self.iterator = data.prompt_iterator(examples, self.config)

    def next_batch(self) -> PromptBatch:
        batch = next(self.iterator)
        return PromptBatch([list(e.prompt_ids) for e in batch], [e.problem.ground_truth for e in batch],
                           [e.problem.data_source for e in batch])

    def get_state(self) -> dict:
        return self.iterator.get_state()

    def set_state(self, state: dict) -> None:
        self.iterator = data.prompt_iterator(self.examples, self.config, state=state)


def build_model(config: ml_collections.ConfigDict, mesh: Mesh | None, tokenizer) -> models.Qwen:
    """The model of a run: model.path (HF dir or checkpoint), else model.preset at random init, else
    the architecture fields of ``config.model`` at random init (tests: a tiny model with the real
    vocabulary)."""
    if config.model.path:
        return checkpoints.from_pretrained(config.model.path, mesh=mesh, **memory_plan.run_options(config))
    architecture = {} if config.model.preset else {"eos_token_id": tokenizer.eos_token_id}
    cfg = memory_plan.model_config(config, vocab_size=len(tokenizer), **architecture)
    return models.init_random(cfg, mesh, seed=config.seed)


def run_training(config: ml_collections.ConfigDict, workdir: str | os.PathLike, mesh: Mesh | None) -> dict:
    """Train per ``config``; returns {"final_step", "eval": last eval metrics, "hf_export": path}."""
    workdir = epath.Path(workdir)
    tokenizer = data.load_tokenizer(config.data.tokenizer)
    model = build_model(config, mesh, tokenizer)
    examples, counts = data.prepare_examples(list(config.data.train_files), tokenizer, config.data.max_prompt_length,
                                             on_error="skip" if config.data.allow_skips else "raise")
    if jax.process_index() == 0:
        print(f"training prompts: {len(examples)} ({counts})", flush=True)
    prompts = GrainPromptSource(examples, config.train.prompts_per_step, config.data.shuffle_seed)
    ec = config.eval
    eval_sets = evaluation.load_eval_sets(ec.sets, dict(ec.set_files), ec.data_dir, ec.max_problems) if ec.sets else []
    last_eval: dict = {}

    def run_eval(step: int, current: models.Qwen, pool: RewardPool) -> None:
        rows, metrics = evaluation.evaluate_sets(
            current, tokenizer, eval_sets, n=ec.n, temperature=ec.temperature, top_p=ec.top_p,
            max_new_tokens=ec.max_new_tokens, seed=config.seed, batch_size=ec.batch_size, reward_pool=pool,
            progress=True)
        if jax.process_index() == 0:
            evaluation.write_outputs(workdir / "eval" / f"step_{step}", rows, metrics)
        last_eval.clear()
        last_eval.update(metrics)

    stop_ids = evaluation.default_stop_ids(model, tokenizer)
    with RewardPool(config.reward.workers or None, config.reward.item_timeout) as pool:  # rollouts and evaluation
        def on_step(step: int, current: models.Qwen, metrics: dict) -> None:
            if eval_sets and ec.every and step % ec.every == 0:
                run_eval(step, current, pool)

        result = rl_train(config, workdir, model, prompts,
                          decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                          stop_token_ids=stop_ids, reward_pool=pool, on_step=on_step)
        if result.stopped_by_signal:
            return {"stopped_at_step": result.final_step}
        if eval_sets and not (ec.every and result.final_step % ec.every == 0):
            run_eval(result.final_step, result.model, pool)
    export = models.export_hf(result.model, workdir / "hf_export", tokenizer_dir=config.data.tokenizer, overwrite=True)
    return {"final_step": result.final_step, "eval": last_eval, "hf_export": str(export)}
