"""The learning signal: fused log-probs, PACS and policy-gradient objectives, PPO's GAE and losses, the loss and gradient.

    logp = rl.token_logprobs(hidden, lm_head, targets)           # [B, T], no [B, T, V] array
    loss, metrics = rl.pacs_loss(logp, old_logp, response_mask, rewards, group_size, beta=1.0)
    objective = rl.get_objective("grpo", loss_agg_mode="token-mean")
    loss_and_grad = rl.loss_and_grad_fn(graphdef, "pacs", group_size=8, num_micro_batches=4)
    advantages, returns = rl.compute_gae(rl.last_token_rewards(rewards, mask), values, mask, gamma=1.0, lam=1.0)
"""

from pacs_jax.rl.advantages import ADVANTAGE_ESTIMATORS, get_estimator
from pacs_jax.rl.batch import BatchTotals
from pacs_jax.rl.critic import critic_loss_and_grad_fn, micro_batched_values, value_mask
from pacs_jax.rl.gae import compute_gae, last_token_rewards, masked_whiten
from pacs_jax.rl.logprobs import (logprobs_of_pass, response_logprobs, token_logprobs,
                                  token_logprobs_and_entropy)
from pacs_jax.rl.loss_and_grad import loss_and_grad_fn
from pacs_jax.rl.objectives import OBJECTIVES, ObjectiveSpec, OptionError, get_objective, objective_spec, options_for
from pacs_jax.rl.pacs import pacs_loss
from pacs_jax.rl.policy_gradient import (LOSS_AGG_MODES, LOSS_SCALES, drgrpo_loss, grpo_loss, policy_gradient_loss,
                                         rloo_loss)
from pacs_jax.rl.ppo import ppo_objective, ppo_policy_loss, value_loss
from pacs_jax.rl.gspo import gspo_loss, gspo_policy_loss
from pacs_jax.rl.cispo import cispo_loss, cispo_policy_loss
from pacs_jax.rl.rollout_correction import correction_and_rejection_mask

__all__ = ["ADVANTAGE_ESTIMATORS", "get_estimator", "BatchTotals", "critic_loss_and_grad_fn", "micro_batched_values",
           "value_mask", "compute_gae",
           "last_token_rewards", "masked_whiten", "token_logprobs", "token_logprobs_and_entropy",
           "OBJECTIVES", "ObjectiveSpec", "OptionError", "get_objective", "objective_spec", "options_for", "pacs_loss",
           "LOSS_AGG_MODES", "LOSS_SCALES", "drgrpo_loss", "grpo_loss", "policy_gradient_loss", "rloo_loss",
           "ppo_objective", "ppo_policy_loss", "value_loss", "loss_and_grad_fn", "logprobs_of_pass",
           "response_logprobs", "gspo_loss", "gspo_policy_loss", "cispo_loss", "cispo_policy_loss",
           "correction_and_rejection_mask"]
