"""The paper's evaluation protocol for its Tables 1 and 2 (arXiv 2509.02522): pass@k up to k = 256 on
AIME 2024, AIME 2025 and AMC23 and up to k = 32 on MATH-500, each sample at temperature 0.6, top_p 0.95,
up to 4096 new tokens. Shared by configs/paper.py (``eval.final``) and configs/eval.py:paper (the
tables' "Base" row, evaluated without training).
"""

import ml_collections

TEMPERATURE, TOP_P, MAX_NEW_TOKENS = 0.6, 0.95, 4096
SAMPLES = {"math_500": 32, "aime_2024": 256, "aime_2025": 256, "amc23": 256}  # samples per problem, per set
SETS = ",".join(SAMPLES)


def per_set() -> ml_collections.ConfigDict:
    """{set name: {n, temperature, top_p, max_new_tokens}}: each table set's own sampling settings."""
    return ml_collections.ConfigDict({
        name: dict(n=n, temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=MAX_NEW_TOKENS)
        for name, n in SAMPLES.items()})
