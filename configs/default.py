"""The CPU demo (``python -m pacs_jax.train`` with no flags).

A tiny Qwen3-architecture model (character tokenizer) learns arithmetic word problems whose answers
go in \\boxed{}: a short supervised warm-start teaches the format, then PACS trains on the verifiable
reward (``rewards.math_reward``). Held-out accuracy is measured before and after the RL phase.
Sized for a 2-core CPU: about 10-15 minutes in all.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = "workdir/demo"

    c.demo = ml_collections.ConfigDict(dict(
        enabled=True,
        train_problems=1000,      # RL and warm-start prompts (disjoint from the held-out ones)
        held_out_problems=200,
        max_operand=30,
        warmstart_steps=1000,     # supervised phase: the format and a first grip on the sums (~1/3 right)
        warmstart_batch_size=32,
        warmstart_lr=1e-3,
        warmstart_seq_len=72,
        eval_samples=8,           # held-out accuracy = mean reward of this many samples at rollout temperature
    ))

    c.model = ml_collections.ConfigDict(dict(
        path="",                  # HF dir or pacs_jax checkpoint; empty: random init of the fields below
        preset="",                # real runs without a path: a models.PRESETS name at random init
        model_type="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10000.0,
        tie_word_embeddings=True, vocab_size=0,  # 0: the tokenizer's vocabulary size
        dtype="float32", param_dtype="float32", remat="none",
        attention="auto",         # auto | xla | cudnn | splash (auto: splash on TPU, cudnn on GPU, xla elsewhere)
        attention_block_size=512,
    ))

    c.mesh = ml_collections.ConfigDict(dict(
        data=-1, fsdp=1, tensor=1,
        device_order=(),          # positions in jax.devices() in mesh order; () = jax.make_mesh's topology-aware order
    ))

    c.data = ml_collections.ConfigDict(dict(
        train_files=(), tokenizer="", max_prompt_length=64,
        prompt_buckets=(64,),     # prompts are left-padded to the smallest bucket that holds the step's longest;
                                  # the last bucket is max_prompt_length; one compiled program set per bucket
        shuffle_seed=0, allow_skips=False,
    ))

    c.rollout = ml_collections.ConfigDict(dict(
        n=8, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12,
        stop_token_ids=(),        # stop ids added to the model's (config.json + generation_config.json) and the tokenizer's eos
        response_buckets=(),      # responses are cut to the smallest bucket that holds the longest one before
                                  # pi_old and the update; () = one bucket, max_new_tokens
        micro_batches=1,          # sampler calls per step (bounds the KV cache: prompts_per_step / this prompts each)
    ))

    c.algorithm = ml_collections.ConfigDict(dict(
        objective="pacs",         # a name in the registry, pacs_jax/rl/objectives.py: pacs | grpo | rloo | drgrpo | ppo
        # the objective's options (the registry's defaults of "pacs"; a test checks they agree); options of the
        # other objectives are left out, so --config.algorithm.objective=ppo runs PPO with its defaults
        options=ml_collections.ConfigDict(dict(
            beta=1.0, use_weight=True, weight_mode="question", reward_method="1", adv_estimator="rloo")),
    ))

    # PPO's critic (read only when algorithm.objective is "ppo"; verl 0.3.1's defaults): a Qwen backbone
    # with a scalar head, sharded like the actor, its own AdamW (constant lr), updated on the actor's
    # mini-batches and micro-batches each step, checkpointed with the actor.
    c.critic = ml_collections.ConfigDict(dict(
        path="",                  # HF dir or pacs_jax checkpoint for its backbone; empty: a copy of the actor's
        lr=1e-5, b1=0.9, b2=0.999, weight_decay=0.01, grad_clip=1.0,
        clip_range_value=0.5,     # value clip around the values at rollout time
        gamma=1.0, lam=1.0,       # GAE discount and lambda (the 0/1 reward sits on each response's last token)
        loss_scale="mean",        # value loss over the mini-batch ("mean") or at verl's micro-batch scale ("verl")
        verl_micro_batch_size=0,  # with loss_scale "verl": verl's critic ppo_micro_batch_size_per_gpu
    ))

    c.optim = ml_collections.ConfigDict(dict(
        lr=3e-4, b1=0.9, b2=0.999, weight_decay=0.01, schedule="constant", warmup_steps=0, grad_clip=0.0,
    ))

    c.train = ml_collections.ConfigDict(dict(
        steps=200,
        prompts_per_step=32,
        mini_batches=4,           # optimizer steps per training step (mini-batches of whole groups)
        micro_batches=1,          # gradient accumulation inside a mini-batch
        logprob_micro_batches=0,  # forward passes of the pi_old pass; 0 = mini_batches x micro_batches
        precompile=True,          # compile every bucket's programs before step 1 (no compilation after)
        checkpoint_every=20,
        keep_checkpoints=3,
    ))

    c.reward = ml_collections.ConfigDict(dict(
        name="math",
        mode="strict",            # strict: our checker (rewards/math.py); paper: the authors' math-verify call (rewards/paper.py)
        item_timeout=5.0, workers=2,
        deadline=120.0,           # seconds to score a step's responses; the unscored ones get one more round
        max_unscored_fraction=0.01,  # still unscored after it (they would score 0): above this the run stops
    ))

    # Periodic pass@k evaluation of real runs (the demo measures its own held-out set).
    c.eval = ml_collections.ConfigDict(dict(
        sets="",                  # e.g. "math_500,aime_2024"; "" = none
        set_files=ml_collections.ConfigDict(dict(
            math_500="math_500/test.jsonl", aime_2024="aime_2024/test.jsonl", aime_2025="aime_2025/test.jsonl",
            amc23="amc23/test.jsonl", gsm8k="gsm8k/test.jsonl")),
        data_dir="data", every=0, n=4, temperature=0.6, top_p=0.95, max_new_tokens=4096,
        max_problems=0, batch_size=32,
    ))
    return c
