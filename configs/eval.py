"""Evaluation: ``python -m pacs_jax.evaluate --config=configs/eval.py[:paper] --checkpoint=DIR``.

Defaults: 16 samples per problem at temperature 0.6, top_p 0.95, up to 4096 new tokens, on MATH-500,
AIME 2024, AIME 2025 and AMC23, scored by the strict reward. ``configs/eval.py:paper`` evaluates as the
paper's tables (configs/paper_evaluation.py): 256 samples per problem on AIME 2024 / 2025 and AMC23,
32 on MATH-500, scored by the authors' math-verify call (reward.mode "paper"). Override any field,
e.g. ``--config.sets=math_500,gsm8k --config.n=64 --config.max_problems=20
--config.per_set.aime_2024.n=64``.
"""

import ml_collections

from configs import paper_evaluation


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    if arg not in ("", "paper"):
        raise ValueError(f"config arg {arg!r}: expected nothing (the defaults) or 'paper' (the paper's tables)")
    c = ml_collections.ConfigDict()
    c.data_dir = "data"                    # set_files are relative to it (absolute paths and tfds:NAME also work)
    c.sets = "math_500,aime_2024,aime_2025,amc23"
    c.set_files = ml_collections.ConfigDict(dict(
        math_500="math_500/test.jsonl",
        aime_2024="aime_2024/test.jsonl",
        aime_2025="aime_2025/test.jsonl",
        amc23="amc23/test.jsonl",
        gsm8k="gsm8k/test.jsonl",
    ))
    c.max_problems = 0                     # > 0: only the first max_problems of each set
    c.n = 16                               # samples per problem; pass@k for k = 1, 2, 4, ... <= n
    c.temperature = 0.6
    c.top_p = 0.95
    c.top_k = 0
    c.max_new_tokens = 4096
    c.max_prompt_length = 2048             # longer prompts are not evaluated (and reported)
    c.stop_token_ids = ()                  # (): the tokenizer's eos token and the model's eos ids
    c.seed = 0
    c.batch_size = 32                      # prompts per generate call (batch_size * n sequences)
    c.sampler = "continuous"               # continuous: `slots` decode slots per call; static: one per sequence
    c.slots = 128                          # continuous: decode slots per call (capped at batch_size * n)
    c.dtype = "bfloat16"                   # compute dtype; "float32" on CPU for exactness
    c.use_mesh = True                      # False: single device, no mesh
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    c.tokenizer = ""                       # "": the checkpoint folder's tokenizer files
    c.output_dir = ""                      # "": <checkpoint>/eval
    c.per_set = ml_collections.ConfigDict()  # {set: {n, temperature, top_p, max_new_tokens}}: that set's own
    c.reward = ml_collections.ConfigDict(dict(
        workers=0, item_timeout=5.0,       # workers 0: CPU count
        mode="strict"))                    # strict: our checker (GSM8K: its number); paper: the authors' call, every set
    c.progress = True
    if arg == "paper":
        c.sets = paper_evaluation.SETS
        c.per_set = paper_evaluation.per_set()
        c.reward.mode = "paper"
    return c
