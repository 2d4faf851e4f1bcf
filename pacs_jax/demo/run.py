"""The embedded demo: warm-start, held-out accuracy, PACS, held-out accuracy again, HF export.

Writes into the workdir: summary.json (accuracy_before_rl, accuracy_after_rl, wall_seconds,
hf_export, ...), curves.png, metrics.jsonl, tensorboard/, checkpoints/, hf_export/.
A restarted demo resumes the RL phase from its checkpoints (the warm-start result is kept in
warmstart.json and the RL checkpoints; the warm-start is not run again).
"""

from __future__ import annotations

import json
import pathlib
import time

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from pacs_jax import models, sampling
from pacs_jax.checkpoints import find_params_dir, load_model
from pacs_jax.demo.task import CharTokenizer, Problem, split_problems
from pacs_jax.demo.warmstart import make_sft_step, sft_arrays
from pacs_jax.files import atomic_write, atomic_write_text
from pacs_jax.rewards import RewardPool
from pacs_jax.training.loop import rl_train
from pacs_jax.training.rollout import PromptBatch


class ProblemCycler:
    """Batches of demo prompts: a fresh seeded shuffle each epoch; state = (epoch, position)."""

    def __init__(self, problems: list[Problem], tokenizer: CharTokenizer, batch_size: int, seed: int):
        self.problems, self.batch_size, self.seed = problems, batch_size, seed
        self.ids = [tokenizer.encode(p.prompt) for p in problems]
        self.epoch, self.position = 0, 0

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.problems))

    def next_batch(self) -> PromptBatch:
        if self.position + self.batch_size > len(self.problems):
            self.epoch, self.position = self.epoch + 1, 0
        rows = self._order()[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return PromptBatch([self.ids[i] for i in rows], [self.problems[i].ground_truth for i in rows],
                           [self.problems[i].data_source for i in rows])

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def set_state(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def held_out_accuracy(model: models.Qwen, problems: list[Problem], tokenizer: CharTokenizer, pool: RewardPool, *,
                      n: int, temperature: float, max_new_tokens: int, seed: int) -> dict[str, float]:
    """Mean reward of ``n`` samples per problem at ``temperature``, and of the greedy answer."""
    prompts = [tokenizer.encode(p.prompt) for p in problems]
    out = {}
    for name, count, temp in (("sampled", n, temperature), ("greedy", 1, 0.0)):
        gen = sampling.generate(model, prompts, max_new_tokens=max_new_tokens, n=count, temperature=temp,
                                stop_token_ids=(tokenizer.eos_id,), seed=seed)
        texts = [tokenizer.decode(t) for t in gen.tokens]
        golds = [p.ground_truth for p in problems for _ in range(count)]
        out[name] = float(np.mean(pool.score(texts, golds, reward="math").scores))
    return out


def _model_config(config: ml_collections.ConfigDict, tokenizer: CharTokenizer) -> models.QwenConfig:
    m = config.model
    return models.QwenConfig(
        model_type=m.model_type, vocab_size=m.vocab_size or tokenizer.vocab_size, hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim,
        rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings, attention_bias=False,
        max_position_embeddings=512, bos_token_id=None, eos_token_id=tokenizer.eos_id, dtype=m.dtype,
        param_dtype=m.param_dtype, remat=m.remat)


def warm_start(model: models.Qwen, problems: list[Problem], tokenizer: CharTokenizer,
               demo: ml_collections.ConfigDict, seed: int) -> models.Qwen:
    """Supervised steps on (prompt, \\boxed{answer}) pairs; returns the updated model."""
    graphdef, params = nnx.split(model)
    optimizer = optax.adamw(demo.warmstart_lr, weight_decay=0.01)
    opt_state = jax.jit(optimizer.init)(params)
    step = make_sft_step(graphdef, optimizer)
    rng = np.random.default_rng(seed)
    bar = tqdm(range(demo.warmstart_steps), desc="warm-start", dynamic_ncols=True)
    for _ in bar:
        rows = rng.choice(len(problems), demo.warmstart_batch_size, replace=False)
        batch = sft_arrays([problems[i] for i in rows], tokenizer, demo.warmstart_seq_len)
        params, opt_state, loss = step(params, opt_state, batch)
        bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)
    return nnx.merge(graphdef, params)


def _plot(history: list[dict], before: float, after: float, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(steps, [h["reward_mean"] for h in history], label="train reward (mean of n samples)")
    ax[0].set_xlabel("RL step")
    ax[0].set_ylabel("reward")
    ax[0].legend()
    ax[1].bar(["before RL", "after RL"], [before, after], color=["tab:gray", "tab:green"])
    ax[1].set_ylim(0, 1)
    ax[1].set_ylabel("held-out accuracy")
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png"), binary=True)
    plt.close(fig)


def run_demo(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, mesh=None) -> dict:
    """The whole demo; returns the summary written to workdir/summary.json."""
    t_start = time.perf_counter()
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    demo, rc = config.demo, config.rollout
    tokenizer = CharTokenizer()
    train_problems, held_out = split_problems(demo.train_problems, demo.held_out_problems, config.seed,
                                              demo.max_operand)
    warm_file = workdir / "warmstart.json"
    resuming = warm_file.is_file() and (workdir / "checkpoints").is_dir()
    eval_kwargs = dict(n=demo.eval_samples, temperature=rc.temperature, max_new_tokens=rc.max_new_tokens,
                       seed=config.seed)
    with RewardPool(config.reward.workers or None, config.reward.item_timeout) as pool:
        if resuming:
            before = json.loads(warm_file.read_text())
            model = load_model(find_params_dir(workdir / "checkpoints")[0], mesh)
        else:
            model = models.init_random(_model_config(config, tokenizer), mesh, seed=config.seed)
            model = warm_start(model, train_problems, tokenizer, demo, config.seed)
            before = held_out_accuracy(model, held_out, tokenizer, pool, **eval_kwargs)
            before["warmstart_seconds"] = time.perf_counter() - t_start
            if jax.process_index() == 0:
                atomic_write_text(warm_file, json.dumps(before, indent=2))
        print(f"held-out accuracy before RL: {before['sampled']:.3f} (sampled, T={rc.temperature}), "
              f"{before['greedy']:.3f} (greedy)", flush=True)

        prompts = ProblemCycler(train_problems, tokenizer, config.train.prompts_per_step, config.data.shuffle_seed)
        result = rl_train(config, workdir, model, prompts, decode=tokenizer.decode,
                          stop_token_ids=(tokenizer.eos_id,), reward_pool=pool)
        if result.stopped_by_signal:
            return {"stopped_at_step": result.final_step}
        after = held_out_accuracy(result.model, held_out, tokenizer, pool, **eval_kwargs)
    print(f"held-out accuracy after RL:  {after['sampled']:.3f} (sampled, T={rc.temperature}), "
          f"{after['greedy']:.3f} (greedy)", flush=True)

    export_dir = models.export_hf(result.model, workdir / "hf_export", overwrite=True)
    history = result.history
    phases = ("time_sample", "time_reward", "time_old_logprob", "time_update")
    summary = {
        "accuracy_before_rl": before["sampled"],
        "accuracy_after_rl": after["sampled"],
        "accuracy_metric": f"mean reward of {demo.eval_samples} samples per held-out problem at temperature "
                           f"{rc.temperature} ({len(held_out)} problems)",
        "greedy_accuracy_before_rl": before["greedy"],
        "greedy_accuracy_after_rl": after["greedy"],
        "rl_steps": result.final_step,
        "wall_seconds": time.perf_counter() - t_start,
        "warmstart_seconds": before.get("warmstart_seconds"),
        "rl_time_split_seconds": {p: float(sum(h[p] for h in history)) for p in phases} if history else {},
        "hf_export": str(export_dir.absolute()),
    }
    if jax.process_index() == 0:  # the files of the run: written once
        if history:
            _plot(history, summary["accuracy_before_rl"], summary["accuracy_after_rl"], workdir / "curves.png")
        atomic_write_text(workdir / "summary.json", json.dumps(summary, indent=2))
    return summary
