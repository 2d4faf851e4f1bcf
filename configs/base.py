"""The config schema: every field of a training run and of the evaluation CLI, at neutral defaults.

The demo (configs/default.py), the paper's setups (configs/paper.py), the demo per objective
(configs/demo_objectives.py) and the evaluation CLI's config (configs/eval.py) are overrides of it.
The model's architecture fields are empty (0, ""): the model comes from ``model.path`` or
``model.preset``, or a config names every architecture field for a model of its own at random init.
``algorithm`` holds one namespace per objective of the registry (pacs_jax/rl/objectives.py), each
with every option at the registry's default: ``--config.algorithm.objective=grpo
--config.algorithm.grpo.clip_ratio_high=0.28``; validate_config refuses an option set in the
namespace of an objective that does not run. Algorithm setups: configs/algorithms.py.
"""

import ml_collections

from pacs_jax.data.prompts import INSTRUCTION
from pacs_jax.rl.objectives import OBJECTIVES


def objective_options() -> dict[str, ml_collections.ConfigDict]:
    """{objective: its options at the registry's defaults}, one namespace per registered objective.
    An option whose default is None (``norm_length``: the padded response width) takes an int."""
    return {name: ml_collections.ConfigDict({
        option: ml_collections.FieldReference(None, field_type=int) if default is None else default
        for option, default in spec.defaults.items()}) for name, spec in OBJECTIVES.items()}


def critic() -> dict:
    """PPO's critic section at verl 0.3.1's defaults."""
    return dict(
        path="",                  # HF dir or pacs_jax checkpoint for its backbone; empty: a copy of the actor's
        lr=1e-5, b1=0.9, b2=0.999, weight_decay=0.01, grad_clip=1.0,
        clip_range_value=0.5,     # value clip around the values at rollout time
        gamma=1.0, lam=1.0,       # GAE discount and lambda (the 0/1 reward sits on each response's last token)
        # the value loss's aggregation: "actor" takes the actor's loss_agg_mode (and norm_length), as verl's
        # critic does (critic.loss_agg_mode: ${actor_rollout_ref.actor.loss_agg_mode}); or a mode of its own
        loss_agg_mode="actor",
        loss_scale="mean",        # value loss over the mini-batch ("mean") or at verl's micro-batch scale ("verl")
        verl_micro_batch_size=0,  # with loss_scale "verl": verl's critic ppo_micro_batch_size_per_gpu
    )


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = "workdir/run"

    c.model = ml_collections.ConfigDict(dict(
        path="",                  # HF dir or pacs_jax checkpoint
        preset="",                # without a path: a models.PRESETS name, trained from random weights only
        random_init=False,        # with random_init True (no path needed): for throughput and memory checks
        # Architecture: "" and 0 come from model.path or model.preset; without either, name every field for a
        # model of your own at random init. config.json in the workdir records the model the run builds.
        model_type="", hidden_size=0, intermediate_size=0, num_hidden_layers=0,
        num_attention_heads=0, num_key_value_heads=0, head_dim=0, rope_theta=0.0,
        tie_word_embeddings=False, vocab_size=0,  # 0: the tokenizer's vocabulary size
        # model_type qwen3_moe (pacs_jax/models/moe.py): experts, the experts a token uses, an expert's width
        num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
        dtype="bfloat16", param_dtype="float32", remat="none",
        attention="auto",         # auto | xla | cudnn | splash (auto: splash on TPU, cudnn on GPU, xla elsewhere)
        attention_block_size=512,
        # a qwen3_moe model's experts split over mesh.fsdp, which must divide them (expert parallelism: each device
        # holds num_experts / fsdp experts whole and the fsdp shards exchange tokens, not weights); False: every
        # expert's weights gathered to each batch shard a layer, as FSDP gathers a dense layer's
        expert_parallel=False,
        # LoRA (verl's names; pacs_jax/models/lora.py): lora_rank 0 = full fine-tuning; > 0 trains adapters A [in, r]
        # and B [r, out] (B = 0 at the start, scale lora_alpha / lora_rank) on target_modules and freezes the rest.
        # Peers' advice: every linear layer, rank >= 32 (rank 1 already matches full RL in "LoRA Without Regret"),
        # and about 10x full fine-tuning's optim.lr.
        lora_rank=0,
        lora_alpha=16.0,
        target_modules=ml_collections.FieldReference("all-linear", field_type=object),  # all-linear | a list of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
                                  # down_proj | a regular expression searched in "self_attn.q_proj", "mlp.up_proj", ...
        # PEFT's target_parameters (verl's model.target_parameters): a Qwen3-MoE model's experts, which are parameters
        # [E, out, in] in transformers, not Linear modules: "mlp.experts.gate_up_proj" (the fused gate and up
        # projections), "mlp.experts.down_proj", or the end of a name ("down_proj"); a list, or names with commas
        target_parameters=ml_collections.FieldReference((), field_type=object),
        # PEFT's modules_to_save: modules LoRA trains whole beside the adapters, by PEFT's rule (an HF module whose
        # name ends with one: "embed_tokens" the embedding (a tied LM head with it), "lm_head", "norm" every norm,
        # "layernorm" a layer's two); their original copy is the KL reference's. A list, or names with commas.
        modules_to_save=ml_collections.FieldReference((), field_type=object),
    ))

    c.mesh = ml_collections.ConfigDict(dict(
        data=-1, fsdp=1, tensor=1,
        device_order=(),          # positions in jax.devices() in mesh order; () = jax.make_mesh's topology-aware order
        rollout_devices=0,        # > 0 (train.off_policy_steps=1): the first this many devices are the rollout engine's
                                  # own mesh (data x tensor, mesh.tensor wide) and data/fsdp/tensor split the rest, the
                                  # learner's; 0: both roles on every device (tools/plan_step.py says which split pays)
    ))

    c.data = ml_collections.ConfigDict(dict(
        source="files",           # files: the problems of train_files | arithmetic: generated word problems
        train_files=(),           # jsonl / json / parquet files, "tfds:NAME" (data/readers.py); FILE:FORMAT names
                                  # one file's format (a name of data/fields.py FORMATS)
        format="auto",            # the train files' format; auto: from a file's name (deepscaler, gsm8k, ...), else
                                  # from its rows' fields ({problem, answer}, {question, answer}, {prompt, ground_truth})
        # with source "arithmetic": training problems to generate (the warm-start's included), operands 1..max_operand
        arithmetic=ml_collections.ConfigDict(dict(problems=0, max_operand=0)),
        held_out_problems=0,      # set aside, never trained on: the eval set "held_out" (data/sources.py)
        warmstart_problems=0,     # set aside for the warm-start only, never sampled by RL; 0: the warm-start
                                  # trains on RL's problems (data/sources.py)
        tokenizer="",             # a Hugging Face tokenizer folder, "char" (data/char_tokenizer.py), or "": the
                                  # model's own (model.path's tokenizer files: its chat template and eos)
        tokenizer_force=False,    # True: use a tokenizer folder of another model family than model.path's
        instruction=INSTRUCTION,  # follows the problem in the user message
        max_prompt_length=512,
        prompt_buckets=(512,),    # prompts are left-padded to the smallest bucket that holds the step's longest;
                                  # the last bucket is max_prompt_length; one compiled program set per bucket
        shuffle_seed=0, allow_skips=False,
    ))

    # Supervised phase before RL (training/learner/warmstart.py): teacher-forced cross-entropy on each of its
    # prompts (data.warmstart_problems) with `response` (the gold answer filled in) as its target; 0 steps: none.
    c.warmstart = ml_collections.ConfigDict(dict(
        steps=0,                  # at most this many optimizer steps
        batch_size=32, lr=1e-5, weight_decay=0.01,
        response="\\boxed{{{answer}}}",  # the target response, str.format'ted with answer=the gold answer
        max_response_tokens=32,   # target responses are right-padded to this many tokens (eos included)
        target_accuracy=0.0,      # > 0: stop once the greedy accuracy on the probe reaches it
        check_every=20,           # steps between probes
        probe_problems=128,       # the first this many of RL's prompts (unseen by the warm-start when
                                  # data.warmstart_problems > 0)
    ))

    c.rollout = ml_collections.ConfigDict(dict(
        n=8, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1024,
        stop_token_ids=(),        # stop ids added to the model's (config.json + generation_config.json) and the tokenizer's eos
        response_buckets=(),      # responses are cut to the smallest bucket that holds the longest one before
                                  # pi_old and the update; () = one bucket, max_new_tokens
        micro_batches=1,          # sampler calls per step (bounds the KV cache: prompts_per_step / this prompts each)
        sampler="paged",          # paged: `slots` decode slots per call, a slot whose response ends takes the next waiting
                                  # one at once, the K/V in a page pool per batch shard (each prompt stored once for its
                                  # n responses, a response's pages taken as it grows, returned at its end; decode reads
                                  # only live pages); continuous: the same queue over a [slots, prompt + max_new] cache;
                                  # static: every response its own slot until the longest ends
        page_size=16,             # paged: tokens a K/V page
        pages=0,                  # paged: response pages of a batch shard's pool; 0: every slot's longest response at once
        slots=128,                # paged, continuous: decode slots per sampler call (capped at its responses, prompts_per_step
                                  # / micro_batches x n; then a multiple of data x fsdp: one queue per batch shard)
        tail_slots=ml_collections.FieldReference(0, field_type=int),  # paged, continuous: > 0, once no response
                                  # waits the decode batch narrows as responses end, down to this many slots (each width
                                  # 2/3-3/4 of the one before: one compiled loop each); 0: all `slots` decode to the
                                  # call's end; None (the paper configs'): the mode's, 0 with carry_over (a call ends
                                  # before its tail), else slots // 8 (training/spec.py rollout_tail_slots)
        max_logprob_diff=0.0,     # > 0: refuse a step whose sampler log-probs differ from pi_old by more than this on
                                  # some response token (metric rollout_logprob_diff_max); 0: only report
        carry_over=False,         # True (paged sampler, one call a step): a step's sampler call ends once it has
                                  # prompts_per_step complete groups; responses still running keep their pages and go on
                                  # in the next step's call with the new weights (docs/design.md 3.2b); the rollout
                                  # correction weighs the stale tokens (token TIS 2.0 unless one is set)
        max_staleness=1,          # carry_over: a prompt batch still unfinished this many steps after its call is dropped
                                  # and its prompts sampled again
        carry_over_order="completion",  # carry_over: which prompts_per_step groups a call returns: "completion", the first
                                  # to complete (the call ends soonest; they are the shorter responses); "admission", the
                                  # oldest (the call waits for them, their lengths unbiased; newer rows decode meanwhile)
    ))

    # objective: a name in the registry (pacs_jax/rl/objectives.py); the others: one namespace per objective
    c.algorithm = ml_collections.ConfigDict(dict(objective="pacs", **objective_options()))
    # Rollout correction (pacs_jax/rl/rollout_correction.py, docs/design.md 6.7), verl's
    # algorithm.rollout_correction: off unless rollout_is or rollout_rs is set, or a preset named.
    c.algorithm.rollout_correction = ml_collections.ConfigDict(dict(
        preset="",                    # token_tis | seq_tis | seq_mis | geo_rs | k3_rs | icepop: its fields, under
                                      # any set here
        rollout_is=ml_collections.config_dict.placeholder(str),  # None | "token" | "sequence": IS weights
        rollout_is_threshold=ml_collections.FieldReference(2.0, field_type=object),  # a number U: truncate at U (TIS); "L_U": mask outside [L, U] (IcePop)
        rollout_is_batch_normalize=False,  # divide the weights by their batch mean
        rollout_rs=ml_collections.config_dict.placeholder(str),  # None | comma list of token_k1/k2/k3,
                                      # seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3: rejection masks
        rollout_rs_threshold=ml_collections.config_dict.placeholder(object),  # one for all, or one per option:
                                      # "L_U" ratio bounds for k1 (k1 bounds pi_rollout / pi_old), an upper bound else
        bypass_mode=False,            # True: the sampler's log-probs as pi_old (no pi_old pass), corrected in the loss
        loss_type="ppo_clip",         # bypass_mode's loss: ppo_clip (the objective; no weights) | reinforce (-A w log pi)
    ))

    # KL to a reference model in the actor's loss (verl's actor.use_kl_loss; pacs_jax/rl/kl.py): the reference is
    # the base model with the adapters off under LoRA, else the model RL starts from (a frozen copy)
    c.algorithm.use_kl_loss = False
    c.algorithm.kl_loss_coef = 0.001
    c.algorithm.kl_loss_type = "low_var_kl"  # k1 (kl) | abs | k2 (mse) | low_var_kl (k3), each also with "+": k2's
                                  # gradient under the estimator's value (verl's straight-through)

    # DAPO's dynamic sampling (pacs_jax/rl/filter_groups.py, docs/design.md 6.9), verl's algorithm.filter_groups:
    # a prompt group whose responses all score the same teaches nothing; it is dropped and more prompts are
    # sampled until the step holds train.prompts_per_step groups that differ.
    c.algorithm.filter_groups = ml_collections.ConfigDict(dict(
        enable=False,
        metric="acc",                 # acc (correct or not) | score | seq_reward | seq_final_reward (all the reward)
        max_num_gen_batches=10,       # sampler batches of train.prompts_per_step prompts a step may take before it
                                      # stops the run naming this field; 0: no limit (verl's meaning)
    ))

    # PPO's critic (read only when algorithm.objective is "ppo"): a Qwen backbone with a scalar head, sharded
    # like the actor, its own AdamW (constant lr), updated on the actor's mini-batches and micro-batches each
    # step, checkpointed with the actor.
    c.critic = ml_collections.ConfigDict(critic())

    c.optim = ml_collections.ConfigDict(dict(
        lr=1e-6, b1=0.9, b2=0.999, weight_decay=0.01, schedule="constant", warmup_steps=0,
        grad_clip=0.0,            # global-norm clipping (0: none)
    ))

    c.train = ml_collections.ConfigDict(dict(
        steps=100,
        prompts_per_step=32,
        mini_batches=1,           # optimizer steps per training step (mini-batches of whole groups)
        micro_batches=1,          # gradient accumulation inside a mini-batch
        logprob_micro_batches=0,  # forward passes of the pi_old pass; 0 = mini_batches x micro_batches
        packing=True,             # pi_old, the update and PPO's critic compute only real tokens: a mini-batch's
                                  # sequences (prompt without padding + response) packed into rows (rl/packing.py),
                                  # run in as few passes as they fill (one compiled program a pass);
                                  # False: every row padded to its prompt bucket + response bucket
        packed_length=0,          # tokens per packed row; 0 = the largest prompt bucket + rollout.max_new_tokens
        packed_rows=0,            # packed rows of a pass on a batch shard (its activation memory: rows x packed_length
                                  # tokens); 0 = a quarter of a padded micro-batch's rows, at least a prompt group's
        precompile=True,          # compile every bucket's programs before step 1 (no compilation after)
        off_policy_steps=0,       # 1: one step off: step k's rollout is sampled with the weights step k - 1 started
                                  # from, while the learner trains step k - 1 (on mesh.rollout_devices of their own);
                                  # its stale tokens are weighed by the rollout correction (token TIS 2.0 unless set)
        router_replay="disabled",  # a mixture-of-experts model (verl's router_replay.mode): "R3", pi_old and the update
                                  # run every token through the experts the sampler chose; "R2", the update through
                                  # those pi_old's router chose (gate weights from the learner's own router either
                                  # way); "disabled": each pass routes afresh (models/moe.py)
        router_aux_loss_coef=0.0,  # a mixture-of-experts model: > 0 adds that times its routers' load-balancing loss
                                  # (transformers' load_balancing_loss_func, HF's config field of the same name) to
                                  # the update's loss; metric actor/router_aux_loss
        checkpoint_every=50,
        keep_checkpoints=3,
        progress_seconds=30.0,    # a phase of a step (sampling, reward, pi_old, update) longer than this prints a line
                                  # this often and at its end (training/progress.py); a step shorter than it prints none
    ))

    c.reward = ml_collections.ConfigDict(dict(
        name="math",
        mode="strict",            # strict: our checker (rewards/math.py); paper: the authors' math-verify call (rewards/paper.py)
        item_timeout=5.0,
        workers=0,                # scoring processes; 0: the CPU count
        deadline=120.0,           # seconds to score a step's responses; the unscored ones get one more round
        max_unscored_fraction=0.01,  # still unscored after it (they would score 0): above this the run stops
    ))

    # Evaluation (pacs_jax/evaluation/): pass@k and the mean sample reward per set. A training run evaluates
    # before RL, every periodic.every steps and at the end, into workdir/eval/<name>/ and summary.json; the
    # evaluation CLI (python -m pacs_jax.evaluate, configs/eval.py) evaluates a checkpoint at the final settings.
    c.eval = ml_collections.ConfigDict(dict(
        sets="",                  # comma-separated: names of set_files, and "held_out" (data.held_out_problems)
        set_files=ml_collections.ConfigDict(dict(
            math_500="math_500/test.jsonl", aime_2024="aime_2024/test.jsonl", aime_2025="aime_2025/test.jsonl",
            amc23="amc23/test.jsonl", gsm8k="gsm8k/test.jsonl", minerva_math="minerva_math/test.jsonl",
            olympiadbench="olympiadbench/test.jsonl")),
        data_dir="data",          # set_files are relative to it (absolute paths and tfds:NAME also work)
        max_new_tokens=1024,
        max_problems=0,           # > 0: the first this many problems of each set
        batch_size=32,            # prompts per sampler call
        sampler="paged",          # as rollout.sampler
        slots=128,                # paged, continuous: decode slots per sampler call (capped at batch_size x n)
        tail_slots=0,             # as rollout.tail_slots
        page_size=16, pages=0,    # as rollout.page_size, rollout.pages
        before_rl=False,          # training: evaluate once before RL (after the warm-start) with the final settings
        periodic=ml_collections.ConfigDict(dict(every=0, n=1, temperature=0.0, top_p=1.0)),  # every k RL steps; T 0: greedy
        final=ml_collections.ConfigDict(dict(
            n=1, temperature=0.0, top_p=1.0,  # samples per problem (pass@k for k = 1, 2, 4, ... <= n); T 0: greedy
            greedy=False,         # training: also one greedy response per problem
            per_set=ml_collections.ConfigDict(),  # {set: {n, temperature, top_p, max_new_tokens}}: a set's own
                                  # settings (the paper's: configs/paper_evaluation.py); others use the above
        )),
    ))
    # The evaluation CLI's own fields (training reads none of them); it also reads seed, model.dtype, mesh,
    # data.tokenizer ("": the checkpoint's tokenizer files, else its training run's), reward and eval.
    c.evaluate = ml_collections.ConfigDict(dict(
        top_k=0,
        max_prompt_length=2048,   # longer prompts are not evaluated (and reported)
        stop_token_ids=(),        # (): the tokenizer's eos token and the model's eos ids
        use_mesh=True,            # False: one device (a 1 x 1 x 1 mesh), whatever `mesh` says
        output_dir="",            # "": <checkpoint>/eval, or <workdir>/eval/evaluate_<which> for a workdir's model
        progress=True,
    ))
    return c
