"""The PACS paper's setups (arXiv 2509.02522; docs/design.md section 6.5) as ml_collections configs.

    python tools/prepare_data.py deepscaler     # once: the training set, data/deepscaler/train.jsonl
    python -m pacs_jax.train --config=configs/paper.py:MODEL,ALGO --config.model.path=HF_DIR --workdir=DIR

    python -m pacs_jax.train --config=configs/paper.py:MODEL,ALGO,cpu     # the same setup as a CPU smoke test

MODEL: qwen25_3b | qwen25_7b | qwen3_4b | qwen3_8b   (sized for a TPU v5p-64 slice: 32 chips of 95 GiB)
       qwen25_7b_v6e                                (Qwen2.5-7B sized for a TPU v6e-64 slice: 64 chips of 32 GiB)
       qwen25_7b_lora                               (Qwen2.5-7B with LoRA rank 32 on every linear layer, lr 1e-5,
                                                     sized for a TPU v5p-16 slice: 8 chips of 95 GiB)
       qwen3_30b_a3b                                (Qwen3-30B-A3B, the mixture of experts, sized for a v5p-64)
       qwen3_30b_a3b_lora                           (the same with LoRA rank 32 on its attention and its experts)
ALGO:  pacs_beta1 | pacs_beta1_noweight | grpo | ppo              (the rows of the tables: PACS, PACS w/o weight,
                                                                 GRPO, PPO)
       pacs_beta0p1 | pacs_beta0p5 | pacs_beta2 | pacs_beta10     (ablation, beta: v2 section 5.1, Figure 4)
       pacs_beta1_grpo_adv | pacs_beta1_drgrpo_adv                (ablation, score function: v2 section 5.2,
                                                                 Appendix D.3, Tables 9-13)
       not in the paper, options of the authors' code only: pacs_beta2_noweight | pacs_beta1_only_positive |
       pacs_beta1_only_negative | pacs_beta1_reward2 | pacs_beta1_naive_adv
       PAPER_SOURCES below names where the paper reports each ALGO; configs/algorithms.py defines them.

SCALE (optional third part): cpu, the setup shrunk to a CPU smoke test (``_cpu_smoke_test``: a tiny
random model of the family, a mixture of experts for qwen3_30b_a3b, 8 prompts x 8 responses of 64 tokens,
every length that depends on them).
A MODEL fixes the mesh and the memory settings (micro-batches, remat) for its slice; the workdir is
named after it. Another slice: pick the nearest entry and override --config.mesh.* /
--config.train.micro_batches / --config.rollout.micro_batches / --config.model.remat, then check
with ``python tools/plan_memory.py --config=... --topology=SLICE`` (ahead-of-time compilation for the
slice on any machine; prints the per-device peak and whether it fits).

Batching of the paper: 1024 prompts x 8 responses per step, 4 optimizer steps of 256 prompts,
300 steps; prompts <= 512 tokens, responses <= 4096; rollout temperature 1.0, top_p 1.0;
AdamW lr 1e-6 constant, betas (0.9, 0.999), weight decay 0.01. PACS: no clipping, no KL;
GRPO (verl defaults): PPO-clip 0.2 with dual clip 3, seq-mean-token-sum-norm at verl's scale
(``loss_scale="verl"``, micro-batches of 8 responses, L_max 4096), grad clip 1.0.
PPO (the authors' scripts/baseline/ppo.sh on verl 0.3.1): the actor as GRPO's (clip 0.2, dual clip 3,
seq-mean-token-sum-norm at verl's scale, grad clip 1.0) on GAE advantages (gamma = lam = 1) of a
critic initialised from the same model: AdamW lr 1e-5, value clip 0.5, grad clip 1.0, its value loss
(verl's, without a 1/2) aggregated as the actor's (seq-mean-token-sum-norm, L_max 4096) at verl's scale
(micro-batches of 8 responses).
"""

import ml_collections

from configs import algorithms, base, paper_evaluation
from pacs_jax.errors import did_you_mean
from pacs_jax.models.config import preset

# Per model: the preset, the mesh (data, fsdp, tensor; -1 fills the slice) and the memory settings of
# one step on the slice it is sized for (see the module docstring), each checked to fit with
# ``python tools/plan_memory.py --config=configs/paper.py:MODEL,pacs_beta1 --topology=SLICE`` (the
# three programs compiled ahead of time for the slice with libtpu 0.0.42; peak GiB per device below).
#   micro_batches          train.micro_batches: gradient accumulation inside a mini-batch (update activations)
#   logprob_micro_batches  train.logprob_micro_batches: forward passes of the pi_old pass
#   rollout_micro_batches  rollout.micro_batches: sampler calls per step (1: all 1024 prompts in one call)
#   slots                  rollout.slots: decode slots of the paged sampler (rollout.sampler "paged"; its page pool
#                          a batch shard: each prompt once + every slot's longest response, slots x 4112 tokens)
#   remat                  model.remat: what the backward pass keeps of each layer
# The sampler compiled for the slice with its slots (plan_memory, jax 0.12.0.1 / libtpu 0.0.50.1; peak + resident state):
# all 1024 prompts of a step in one call, no parameter all-gather and no copy of the page pool inside its
# decode loops.
#
# Slots, re-planned with the paged sampler (2026-11-26; the continuous sampler's [slots, 4608] cache rows
# held each prompt n times): the Qwen2.5 models keep 4096 slots, half the step's 8192 rows at once, at a
# lower peak (3B 41.3 -> 29.3 GiB, 7B 39.9 -> 36.0, 7B on v6e-64 21.8 -> 19.8): their sampler never bounded
# them. The Qwen3 models ran 2048 because the contiguous cache filled HBM (4B 76.1 GiB, 8B 70.1); paged
# they run more rows at once: 8B 4096 slots at 82.7 GiB (2048 would be 46.8), 4B 3072 at 70.7 GiB (4096
# would peak at 89.7 GiB, 94 % of HBM: too little left for what XLA's compile-time peak does not count).
# More rows at once: fewer decode steps a step, each reading the weights once whatever its width.
_DOTS = "dots_with_no_batch_dims_saveable"
MODELS = {
    # v5p-64 (32 chips, 95 GiB HBM each). Peak per device, compiled (sampler / pi_old / update, GiB; the
    # AdamW state counted in all three; the sampler with its tail narrowing to slots / 8; pi_old and the
    # update packed, train.packing): 3B 29.3 / 6.1 / 25.1, 7B 36.0 / 4.6 / 19.2, 4B 70.7 / 7.8 / 28.0,
    # 8B 82.7 / 4.5 / 20.2
    "qwen25_3b": dict(preset="Qwen2.5-3B", mesh=(-1, 8, 1), micro_batches=32, logprob_micro_batches=32,
                      rollout_micro_batches=1, slots=4096, remat=_DOTS),
    "qwen25_7b": dict(preset="Qwen2.5-7B", mesh=(-1, 8, 4), micro_batches=32, logprob_micro_batches=64,
                      rollout_micro_batches=1, slots=4096, remat=_DOTS),
    "qwen3_4b": dict(preset="Qwen3-4B", mesh=(-1, 8, 1), micro_batches=32, logprob_micro_batches=32,
                     rollout_micro_batches=1, slots=3072, remat=_DOTS),
    "qwen3_8b": dict(preset="Qwen3-8B", mesh=(-1, 8, 4), micro_batches=32, logprob_micro_batches=64,
                     rollout_micro_batches=1, slots=4096, remat=_DOTS),
    # v6e-64 (64 chips, 32 GiB HBM each): 19.8 / 2.3 / 9.9 GiB
    "qwen25_7b_v6e": dict(preset="Qwen2.5-7B", mesh=(-1, 16, 4), micro_batches=64, logprob_micro_batches=64,
                          rollout_micro_batches=1, slots=4096, remat=_DOTS),
    # LoRA (issue 65): rank 32 (verl: >= 32), alpha 64 (2 r; Tunix's Qwen3 recipe: rank 64, alpha 64) on every linear layer,
    # optim.lr 10x the paper's 1e-6 (verl's and "LoRA Without Regret"'s advice), the base
    # frozen, AdamW's state the adapters' (81M parameters): the 7B on a quarter of the v5p-64's chips, v5p-16's
    # peaks 52.6 / 7.8 / 72.5 GiB (docs/measurements.md section 8b)
    "qwen25_7b_lora": dict(preset="Qwen2.5-7B", mesh=(1, 2, 4), micro_batches=32, logprob_micro_batches=64,
                           rollout_micro_batches=1, slots=1024, remat=_DOTS, lora=dict(rank=32, alpha=64.0)),
    # Qwen3-30B-A3B (issue 66: 48 layers of 128 experts, 8 a token), v5p-64: 74.5 / 14.9 / 30.2 GiB (the sampler
    # 67.3 + 7.1 of AdamW state). The 8B's setup with 2048 slots: its 4096 slots' page pool (49 GiB a device beside
    # the decode layout's 14.2 GiB of bfloat16 weights) would peak at 98.5 GiB.
    "qwen3_30b_a3b": dict(preset="Qwen3-30B-A3B", mesh=(-1, 8, 4), micro_batches=32, logprob_micro_batches=64,
                          rollout_micro_batches=1, slots=2048, remat=_DOTS),
    # Qwen3-30B-A3B with LoRA rank 32, alpha 64 on its attention (all-linear: PEFT's, the experts are no Linear)
    # and on every expert's weights (PEFT's target_parameters, as verl's model.target_parameters passes them)
    "qwen3_30b_a3b_lora": dict(preset="Qwen3-30B-A3B", mesh=(-1, 8, 4), micro_batches=32, logprob_micro_batches=64,
                               rollout_micro_batches=1, slots=2048, remat=_DOTS,
                               lora=dict(rank=32, alpha=64.0, target_parameters=("mlp.experts.gate_up_proj",
                                                                                 "mlp.experts.down_proj"))),
}
LORA_LR_SCALE = 10  # a LoRA MODEL's optim.lr: this many times the paper's

# ALGO: the paper's setups of configs/algorithms.py, at L_max 4096, with where arXiv 2509.02522 reports each
# (v1, Sep 2025: Tables 1 and 2 on Qwen2.5-3B / 7B, read from the authors' README images; v2, Feb 2026: the
# same methods on Qwen3-4B / 8B and section 5's ablations, all of them on Qwen3 models). Every PACS ablation
# is pacs_beta1 with one option changed. The v2 runs differ from these configs beyond the ALGO: prompts
# <= 1024 and responses <= 8192 tokens, 120 steps (Qwen3-4B) / 320 (Qwen3-8B), pass@k up to 64 from 128
# samples at <= 8192 tokens, and BeyondAIME among the sets (v2 Appendix C, Tables 4 and 5; section 4.1).
PAPER_SOURCES = {
    "pacs_beta1": "v1 Tables 1-2 and v2 Tables 2, 6-8, row PACS (beta = 1: v2 section 4.1)",
    "pacs_beta1_noweight": "v1 Table 2 and v2 Tables 2, 6-8, row 'w/o weight' (v2 section 5.3, weight integration)",
    "grpo": "v1 Tables 1-2 and v2 Tables 2, 6-8, row GRPO",
    "ppo": "v1 Tables 1-2 and v2 Tables 2, 6-8, row PPO",
    # v2 section 5.1 "Different beta": beta in {0.1, 0.5, 1, 2, 10}, pass@k (k = 1..64) on AMC23, AIME 2024,
    # AIME 2025 and BeyondAIME as 3D heatmaps (Figure 4; no numbers printed); beta 1 chosen for pass@1
    "pacs_beta0p1": "v2 section 5.1, Figure 4 (beta = 0.1)",
    "pacs_beta0p5": "v2 section 5.1, Figure 4 (beta = 0.5)",
    "pacs_beta2": "v2 section 5.1, Figure 4 (beta = 2); the authors' scripts/pacs/pacs_beta_2.0.sh",
    "pacs_beta10": "v2 section 5.1, Figure 4 (beta = 10)",
    # v2 section 5.2 "Different score function": RLOO (pacs_beta1) against GRPO's and Dr. GRPO's estimators,
    # Qwen3-4B, pass@k (k = 1..64) on MATH 500, AMC23, AIME 2024, AIME 2025, BeyondAIME
    "pacs_beta1_grpo_adv": "v2 section 5.2, Appendix D.3, Tables 9-13, row '- GRPO' (Qwen3-4B)",
    "pacs_beta1_drgrpo_adv": "v2 section 5.2, Appendix D.3, Tables 9-13, row '- Dr. GRPO' (Qwen3-4B)",
}
# Options of the authors' code (src/pacs/pacs_core_algos.py, the scripts' variables) that neither version of
# the paper reports: pacs_beta1 (pacs_beta2 for the first) with one option changed, for exploration.
NOT_IN_PAPER = ("pacs_beta2_noweight", "pacs_beta1_only_positive", "pacs_beta1_only_negative", "pacs_beta1_reward2",
                "pacs_beta1_naive_adv")
# Objectives the paper does not compare, at the paper's MODEL settings: GSPO and CISPO as verl's examples run
# them (configs/algorithms.py), for comparison with PACS on the same setup.
OTHER_OBJECTIVES = ("gspo", "cispo")
ALGORITHMS = tuple(PAPER_SOURCES) + NOT_IN_PAPER + OTHER_OBJECTIVES
MAX_NEW_TOKENS = 4096


def get_config(arg: str = "qwen25_7b,pacs_beta1") -> ml_collections.ConfigDict:
    model_name, _, rest = arg.partition(",")
    algo_name, _, scale = rest.partition(",")
    if model_name not in MODELS:
        raise ValueError(f"config arg model {model_name!r}: expected one of {sorted(MODELS)}"
                         f"{did_you_mean(model_name, MODELS)}")
    algo_name = algo_name or "pacs_beta1"
    if algo_name not in ALGORITHMS:
        raise ValueError(f"config arg algorithm {algo_name!r}: expected one of {sorted(ALGORITHMS)}"
                         f"{did_you_mean(algo_name, ALGORITHMS)}")
    if scale not in SCALES:
        raise ValueError(f"config arg scale {scale!r}: expected one of {SCALES} (or none: the paper's size)"
                         f"{did_you_mean(scale, SCALES)}")
    spec = MODELS[model_name]
    preset, (data, fsdp, tensor) = spec["preset"], spec["mesh"]

    c = base.get_config()
    c.workdir = f"workdir/{model_name}_{algo_name}"
    # A paper run starts from the released model: --config.model.path=DIR (its HF folder). Without it
    # validate_config refuses the run, naming model.path; --config.model.random_init=True trains the preset
    # from random weights (no model.path needed), for throughput and memory checks only.
    c.model.preset = preset
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat = spec["remat"]
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = data, fsdp, tensor
    c.data.source = "files"
    # The full DeepScaleR-Preview set (40,315 rows, 6 without an answer: 40,309 problems), made by
    # `python tools/prepare_data.py deepscaler` (pacs_jax/data/deepscaler.py: DEFAULT_TRAIN_FILE);
    # validate_config says so when it is missing. The subset in the repository instead:
    # --config.data.train_files="('data/deepscaler_subset/math.json', 'data/deepscaler_subset/aime.json')"
    c.data.train_files = ("data/deepscaler/train.jsonl",)
    # The released model's own tokenizer (model.path's files), as the authors' verl run loads it: Qwen2.5
    # base models' chat template puts the default system prompt before the user turn and ends at
    # <|endoftext|>, Qwen3's has no default system prompt and ends at <|im_end|> (data/prompts.py)
    c.data.tokenizer = ""
    c.data.allow_skips = True
    c.data.max_prompt_length = 512
    c.data.prompt_buckets = (256, 512)
    c.rollout.n = 8
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.max_new_tokens = MAX_NEW_TOKENS
    c.rollout.response_buckets = (1024, 2048, 3072, 4096)
    c.rollout.micro_batches = spec["rollout_micro_batches"]
    c.rollout.sampler, c.rollout.slots = "paged", spec["slots"]
    # Once no response waits, the decode batch narrows as responses end, to slots / 8 (64 a batch shard on
    # v5p-64): below that a decode step's cost is mostly the weights' HBM reads, so narrower widths save
    # little, and each width is one more compiled decode loop. None: that, or 0 with --config.rollout.carry_over=True,
    # whose calls end before their tail (training/spec.py rollout_tail_slots).
    c.rollout.tail_slots = None
    # With carry-over, a prompt batch still unfinished 3 calls after its own is dropped: on these lengths
    # (tools/plan_step.py's log-normal, median 512 of 4096) every paper model's plan drops none at 3, 8-11 % of
    # the decoded tokens at 2 and 17-31 % at 1, the longest responses (a sample biased short). Each more
    # keeps a generation's prompts and rows on the devices and prefills its prompts again every call; the
    # tokens, up to 3 policy versions old, are weighed by the rollout correction (token TIS 2.0 unless set).
    c.rollout.max_staleness = 3
    algorithms.setup(algo_name, MAX_NEW_TOKENS).apply(c)
    c.optim.lr = 1e-6
    if "lora" in spec:
        c.model.lora_rank, c.model.lora_alpha = spec["lora"]["rank"], spec["lora"]["alpha"]
        c.model.target_parameters = spec["lora"].get("target_parameters", ())
        c.optim.lr *= LORA_LR_SCALE
    c.optim.schedule = "constant"
    c.train.steps = 300
    c.train.prompts_per_step = 1024
    c.train.mini_batches = 4
    c.train.micro_batches = spec["micro_batches"]
    c.train.logprob_micro_batches = spec["logprob_micro_batches"]
    c.train.checkpoint_every = 20
    c.train.keep_checkpoints = 3
    c.reward.workers = 0
    c.reward.mode = "paper"  # the authors' math-verify call on the whole response (src/reward_function.py)
    c.reward.item_timeout = 15.0  # math-verify's own limits (5 s per parse, 5 s to compare) run out first
    c.warmstart.steps = 0  # the paper starts RL from the released models
    # The authors' evaluation: greedy every 5 steps on the test sets (GSM8K included), scored by the
    # same math-verify call as training (reward.mode "paper"); the tables' final inference
    # (configs/paper_evaluation.py) before RL (the "Base" row) and after: 256 samples per problem on
    # AIME 2024 / 2025 and AMC23, 32 on MATH-500 (and GSM8K), at T = 0.6, top_p 0.95.
    c.eval.sets = "math_500,aime_2024,aime_2025,amc23,gsm8k"
    c.eval.max_new_tokens = paper_evaluation.MAX_NEW_TOKENS
    c.eval.batch_size, c.eval.slots, c.eval.tail_slots = 32, 256, 32
    c.eval.before_rl = True  # the tables' "Base" row (--config.eval.before_rl=False skips it)
    c.eval.periodic.update(every=5, n=1, temperature=0.0, top_p=1.0)
    c.eval.final.update(n=32, temperature=paper_evaluation.TEMPERATURE, top_p=paper_evaluation.TOP_P, greedy=False,
                        per_set=paper_evaluation.per_set())
    if scale == "cpu":
        _cpu_smoke_test(c, model_name, algo_name)
    return c


# The ",cpu" scale: the setup's algorithm, reward, chat template, prompt buckets, n = 8 and mini-batch count on
# a tiny random model of its family, small enough for a CPU: 4 steps, about 50 s each on 2 cores (the real
# vocabulary's logits dominate), and evaluations of a minute each (before RL, at steps 2 and 4, final).
SCALES = ("", "cpu")
CPU_MAX_NEW_TOKENS = 64
CPU_TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True,
                      vocab_size=0)  # vocab 0: the tokenizer's
CPU_TINY_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)  # a MoE MODEL's sparse block


def _cpu_smoke_test(c: ml_collections.ConfigDict, model_name: str, algo_name: str) -> None:
    """Shrink a paper setup to a CPU smoke test, every dependent field with it: a tiny random model of
    the family (a MoE MODEL's with CPU_TINY_EXPERTS; the repository's Qwen tokenizer: no model.path), the
    DeepScaleR subset in data/, 8 prompts x 8 responses of <= CPU_MAX_NEW_TOKENS tokens (the response buckets, the algorithm's L_max,
    the evaluation lengths, every eval.final.per_set entry's too), fp32, no remat, the mesh over
    whatever devices there are (fsdp), the evaluations on the first 8 problems of MATH-500 and AMC23."""
    family = preset(c.model.preset).model_type  # qwen2, qwen3 or qwen3_moe
    c.workdir = f"workdir/{model_name}_{algo_name}_cpu"
    c.model.preset, c.model.model_type = "", family
    c.model.update(CPU_TINY_MODEL)
    if family == "qwen3_moe":
        c.model.update(CPU_TINY_EXPERTS)
    c.model.dtype, c.model.param_dtype, c.model.remat = "float32", "float32", "none"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.data.train_files = ("data/deepscaler_subset/math.json", "data/deepscaler_subset/aime.json")
    c.rollout.max_new_tokens = CPU_MAX_NEW_TOKENS
    c.rollout.response_buckets = (CPU_MAX_NEW_TOKENS // 2, CPU_MAX_NEW_TOKENS)
    c.rollout.micro_batches, c.rollout.slots, c.rollout.tail_slots = 2, 32, 0
    algorithms.setup(algo_name, CPU_MAX_NEW_TOKENS).apply(c)  # L_max: the responses' length
    c.train.steps, c.train.prompts_per_step = 4, 8
    c.train.micro_batches, c.train.logprob_micro_batches = 1, 0
    c.train.checkpoint_every = 2
    c.reward.workers = 2
    c.eval.sets = "math_500,amc23"
    c.eval.max_problems, c.eval.max_new_tokens = 8, CPU_MAX_NEW_TOKENS
    c.eval.batch_size, c.eval.slots, c.eval.tail_slots = 8, 32, 0
    c.eval.periodic.every = 2
    c.eval.final.n = 4
    for settings in c.eval.final.per_set.values():
        settings.update(n=4, max_new_tokens=CPU_MAX_NEW_TOKENS)
