"""pacs_jax: PACS (RLVR recast as supervised learning) for Qwen models in JAX/Flax.

Submodules: models, sharding, sampling, rl, rewards, data, evaluation, checkpoints, training; the CLIs
train and evaluate.
Import what you need, e.g. ``from pacs_jax import models, sampling``.
"""

__version__ = "0.1.0"
