"""The sampler/learner log-prob gap of LoRA's two ways to sample (decision 0013): unmerged (the learner's own
model, adapters applied as it applies them) and merged (W + alpha / r A B in the master weights' dtype, computed
as the learner computes). A random Qwen3 of the demo's shape in the paper's dtypes (bfloat16 compute, float32
parameters), rank ``--rank`` on every linear layer with B drawn as a trained adapter's (normal, ``--b_scale``);
the log-prob of each next token of random sequences.

    python tools/compare_lora_sampler.py [--rank 32] [--alpha 64] [--b_scale 0.05] [--seeds 0,1]

Prints, per seed, the max and mean |log-prob| gap of each way to the learner's, beside the adapters' own move of
the log-probs (adapters off against on).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from pacs_jax import models  # noqa: E402
from pacs_jax.models import lora  # noqa: E402
from pacs_jax.models.config import LORA_MODULES  # noqa: E402


@nnx.jit
def token_logprobs(model, tokens):
    """[B, T - 1]: log p(tokens[:, t + 1] | tokens[:, :t + 1]) in float32."""
    logp = jax.nn.log_softmax(model(tokens).astype(jnp.float32), axis=-1)[:, :-1]
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def trained_b(model, seed: int, scale: float):
    """``model`` with every adapter's B drawn from normal(0, scale) (a fresh adapter has B = 0)."""
    graphdef, state = nnx.split(model)
    key = jax.random.key(seed)
    flat = [(path, var.replace(value=scale * jax.random.normal(jax.random.fold_in(key, i), var.get_value().shape))
             if getattr(var, "lora_factor", None) == "b" else var)
            for i, (path, var) in enumerate(nnx.to_flat_state(state))]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=64.0)
    parser.add_argument("--b_scale", type=float, default=0.05)
    parser.add_argument("--seeds", default="0,1")
    args = parser.parse_args(argv)
    cfg = models.QwenConfig(model_type="qwen3", vocab_size=4096, hidden_size=128, intermediate_size=256,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            tie_word_embeddings=True, attention_bias=False, dtype="bfloat16", param_dtype="float32")
    tokens = jax.random.randint(jax.random.key(7), (8, 64), 0, cfg.vocab_size)
    base = models.init_random(cfg, seed=3)
    plain = np.asarray(token_logprobs(base, tokens), np.float64)
    for seed in (int(s) for s in args.seeds.split(",")):
        model = trained_b(lora.attach(base, rank=args.rank, alpha=args.alpha, targets=LORA_MODULES, seed=seed),
                          seed + 100, args.b_scale)
        learner = np.asarray(token_logprobs(model, tokens), np.float64)
        merged = np.asarray(token_logprobs(lora.merge(model), tokens), np.float64)

        def gap(x):
            d = np.abs(x - learner)
            return f"max {d.max():.4f} mean {d.mean():.5f}"

        print(f"seed {seed} (rank {args.rank}, alpha {args.alpha:g}): unmerged {gap(learner)}; merged {gap(merged)}; "
              f"the adapters' own move {gap(plain)}", flush=True)


if __name__ == "__main__":
    main()
