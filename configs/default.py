"""The CPU demo (``python -m pacs_jax.train`` with no flags), and every field's default.

A tiny Qwen3-architecture model (character tokenizer) learns arithmetic word problems whose answers
go in \\boxed{}: the ordinary trainer with the generated task as its data source
(``data.source = "arithmetic"``), a supervised warm-start on problems of its own that teaches the
answer format and some arithmetic (``warmstart``, ``data.warmstart_problems``), then PACS on the
verifiable reward (``rewards.math_reward``) on problems the warm-start never saw, so that RL has to
improve the skill rather than recall memorised answers. Accuracy on held-out problems is measured
before and after RL (``eval``). Sized for a 2-core CPU.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = "workdir/demo"

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
        source="arithmetic",      # files: the problems of train_files | arithmetic: generated word problems
        train_files=(),           # jsonl / json / parquet files, "tfds:NAME" (data/readers.py)
        # training problems to generate (the warm-start's included), operands 1..max_operand
        arithmetic=ml_collections.ConfigDict(dict(problems=2200, max_operand=40)),
        held_out_problems=200,    # set aside, never trained on: the eval set "held_out" (data/sources.py)
        warmstart_problems=1400,  # set aside for the warm-start only, never sampled by RL; 0: the warm-start
                                  # trains on RL's problems (data/sources.py); RL has the other 800
        tokenizer="char",         # a Hugging Face tokenizer folder, "char" (data/char_tokenizer.py), or "": the
                                  # model's own (model.path's tokenizer files: its chat template and eos)
        tokenizer_force=False,    # True: use a tokenizer folder of another model family than model.path's
        instruction="",           # follows the problem in the user message; real runs: data.INSTRUCTION
        max_prompt_length=56,     # the demo's longest prompt is 55 characters; 64 cost a tenth more per step (README)
        prompt_buckets=(56,),     # prompts are left-padded to the smallest bucket that holds the step's longest;
                                  # the last bucket is max_prompt_length; one compiled program set per bucket
        shuffle_seed=0, allow_skips=False,
    ))

    # Supervised phase before RL (training/warmstart.py): teacher-forced cross-entropy on each of its
    # prompts (data.warmstart_problems) with `response` (the gold answer filled in) as its target; 0 steps: none.
    # Held-out accuracy climbs suddenly during the demo's warm-start, at a step that depends on the seed (760-1300
    # steps measured); stopping at a greedy accuracy on RL's own prompts, which the warm-start never trains on,
    # lands seeds 0-2 at 0.46-0.62 greedy held-out accuracy (README).
    c.warmstart = ml_collections.ConfigDict(dict(
        steps=1600,               # at most this many optimizer steps
        batch_size=32, lr=1e-3, weight_decay=0.01,
        response="\\boxed{{{answer}}}",  # the target response, str.format'ted with answer=the gold answer
        max_response_tokens=12,   # target responses are right-padded to this many tokens (eos included)
        target_accuracy=0.45,     # > 0: stop once the greedy accuracy on the probe reaches it (README: where
                                  # the demo's seeds land with it)
        check_every=20,           # steps between probes
        probe_problems=128,       # the first this many of RL's prompts (unseen by the warm-start when
                                  # data.warmstart_problems > 0)
    ))

    c.rollout = ml_collections.ConfigDict(dict(
        n=8, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12,
        stop_token_ids=(),        # stop ids added to the model's (config.json + generation_config.json) and the tokenizer's eos
        response_buckets=(),      # responses are cut to the smallest bucket that holds the longest one before
                                  # pi_old and the update; () = one bucket, max_new_tokens
        micro_batches=1,          # sampler calls per step (bounds the KV cache: prompts_per_step / this prompts each)
        sampler="continuous",     # continuous: `slots` decode slots per call, a slot whose response ends takes the next
                                  # waiting one at once; static: every response its own slot until the longest ends
        slots=128,                # continuous: decode slots per sampler call (capped at its responses, prompts_per_step /
                                  # micro_batches x n; then a multiple of data x fsdp: one queue per batch shard)
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
        # the value loss's aggregation: "actor" takes the actor's loss_agg_mode (and norm_length), as verl's
        # critic does (critic.loss_agg_mode: ${actor_rollout_ref.actor.loss_agg_mode}); or a mode of its own
        loss_agg_mode="actor",
        loss_scale="mean",        # value loss over the mini-batch ("mean") or at verl's micro-batch scale ("verl")
        verl_micro_batch_size=0,  # with loss_scale "verl": verl's critic ppo_micro_batch_size_per_gpu
    ))

    c.optim = ml_collections.ConfigDict(dict(
        lr=3e-4, b1=0.9, b2=0.999, weight_decay=0.01, schedule="constant", warmup_steps=0,
        grad_clip=1.0,            # global-norm clipping (0: none); the demo gains on every seed only with it (README)
    ))

    c.train = ml_collections.ConfigDict(dict(
        steps=240,                # the demo: held-out accuracy measured every 25 steps chose it (README)
        prompts_per_step=32,
        mini_batches=4,           # optimizer steps per training step (mini-batches of whole groups)
        micro_batches=1,          # gradient accumulation inside a mini-batch
        logprob_micro_batches=0,  # forward passes of the pi_old pass; 0 = mini_batches x micro_batches
        precompile=True,          # compile every bucket's programs before step 1 (no compilation after)
        checkpoint_every=50,
        keep_checkpoints=3,
    ))

    c.reward = ml_collections.ConfigDict(dict(
        name="math",
        mode="strict",            # strict: our checker (rewards/math.py); paper: the authors' math-verify call (rewards/paper.py)
        item_timeout=5.0, workers=2,
        deadline=120.0,           # seconds to score a step's responses; the unscored ones get one more round
        max_unscored_fraction=0.01,  # still unscored after it (they would score 0): above this the run stops
    ))

    # Evaluation (pacs_jax/evaluation/): pass@k and the mean sample reward per set, written to
    # workdir/eval/<name>/ and summary.json.
    c.eval = ml_collections.ConfigDict(dict(
        sets="held_out",          # comma-separated: names of set_files, and "held_out" (data.held_out_problems)
        set_files=ml_collections.ConfigDict(dict(
            math_500="math_500/test.jsonl", aime_2024="aime_2024/test.jsonl", aime_2025="aime_2025/test.jsonl",
            amc23="amc23/test.jsonl", gsm8k="gsm8k/test.jsonl", minerva_math="minerva_math/test.jsonl",
            olympiadbench="olympiadbench/test.jsonl")),
        data_dir="data",
        max_new_tokens=12,
        max_problems=0,           # > 0: the first this many problems of each set
        batch_size=200,           # prompts per sampler call
        sampler="continuous",     # as rollout.sampler
        slots=256,                # continuous: decode slots per sampler call (capped at batch_size x n)
        before_rl=True,           # evaluate once before RL (after the warm-start) with the final settings
        periodic=ml_collections.ConfigDict(dict(every=0, n=1, temperature=0.0, top_p=1.0)),  # every k RL steps; T 0: greedy
        final=ml_collections.ConfigDict(dict(
            n=8, temperature=1.0, top_p=1.0,
            greedy=True,          # also one greedy response per problem
            per_set=ml_collections.ConfigDict(),  # {set: {n, temperature, top_p, max_new_tokens}}: a set's own
                                  # settings (the paper's: configs/paper_evaluation.py); others use the above
        )),
    ))
    return c
