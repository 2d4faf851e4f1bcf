"""Each algorithm setup, written once: the objective, its options, the actor's gradient clipping and
PPO's critic. Shared by configs/paper.py (ALGO) and configs/demo_objectives.py.

``setup(name, response_length)`` is one complete override: applied to any config, every objective's
options go back to the registry's defaults (configs/base.py) and the critic to verl's, then the
setup's own values are set. ``response_length`` is L_max of the losses that normalise by it
(``norm_length``): the paper's 4096, the demo's rollout.max_new_tokens.
"""

import dataclasses

import ml_collections

from configs import base
from pacs_jax.errors import did_you_mean

_CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)  # PPO-clip 0.2, dual clip 3 (verl)


@dataclasses.dataclass(frozen=True)
class Setup:
    """objective: a registry name; options: over its registry defaults; grad_clip: optim.grad_clip
    (0: none); critic: over configs/base.py's critic (read by "ppo" only)."""

    objective: str
    options: dict
    grad_clip: float
    critic: dict = dataclasses.field(default_factory=dict)

    def apply(self, config: ml_collections.ConfigDict) -> None:
        config.algorithm.objective = self.objective
        for name, options in base.objective_options().items():
            config.algorithm[name] = options
        config.algorithm[self.objective].update(self.options)
        config.optim.grad_clip = self.grad_clip
        config.critic.update(base.critic(), **self.critic)


def _verl_actor(response_length: int) -> dict:
    """verl 0.3.1's actor loss (the authors' scripts/baseline/grpo.sh and ppo.sh): PPO-clip with dual clip,
    seq-mean-token-sum-norm over L_max at verl's micro-batch scale (ppo_micro_batch_size_per_gpu 8)."""
    return dict(_CLIP, loss_agg_mode="seq-mean-token-sum-norm", loss_scale="verl", verl_micro_batch_size=8,
                norm_length=response_length)


def _pacs(**options) -> Setup:
    """PACS (the authors' src/pacs/pacs_core_algos.py), no clipping. Options not named take the registry's
    defaults, what the authors' scripts/pacs/pacs_beta_{1.0,2.0}.sh pass: reward_method '1',
    ADV_ESTIMATOR=rloo, WEIGHT_MODE=question."""
    return Setup("pacs", options, grad_clip=0.0)


def setups(response_length: int) -> dict[str, Setup]:
    """Every setup by name, at ``response_length``."""
    return {
        # PACS as the paper reports it (arXiv 2509.02522). v1 (Sep 2025): Tables 1 and 2, Qwen2.5-3B / 7B;
        # v2 (Feb 2026): Tables 1, 2, 6-8, Qwen3-4B / 8B, and section 5's ablations. configs/paper.py's
        # PAPER_SOURCES names, for every ALGO, where the paper reports it.
        #   the authors' scripts/pacs/pacs_beta_{1.0,2.0}.sh (BETA=1.0 / 2.0, USE_WEIGHT=True); v2 section 4.1:
        #   "For PACS, beta is set to 1.0"
        "pacs_beta1": _pacs(beta=1.0, use_weight=True),
        "pacs_beta2": _pacs(beta=2.0, use_weight=True),
        #   USE_WEIGHT=False: the "w/o weight" rows (v1 Table 2; v2 section 5.3, Tables 2 and 6-8)
        "pacs_beta1_noweight": _pacs(beta=1.0, use_weight=False),
        #   not reported (pacs_beta_2.0.sh with USE_WEIGHT=False): kept as an ALGO of earlier releases
        "pacs_beta2_noweight": _pacs(beta=2.0, use_weight=False),
        #   v2 section 5.1 "Different beta", Figure 4: beta in {0.1, 0.5, 1, 2, 10} (1 and 2 above)
        "pacs_beta0p1": _pacs(beta=0.1, use_weight=True),
        "pacs_beta0p5": _pacs(beta=0.5, use_weight=True),
        "pacs_beta10": _pacs(beta=10.0, use_weight=True),
        #   v2 section 5.2 "Different score function" (Appendix D.3, Tables 9-13, Qwen3-4B): psi by GRPO's
        #   estimator, (r - mean) / (std + 1e-6) with torch's unbiased std (the authors' adv_estimator=grpo,
        #   norm_adv_by_std_in_grpo=True), or Dr. GRPO's, r - mean (their grpo with
        #   norm_adv_by_std_in_grpo=False; eq. (10) of v2)
        "pacs_beta1_grpo_adv": _pacs(beta=1.0, use_weight=True, adv_estimator="grpo"),
        "pacs_beta1_drgrpo_adv": _pacs(beta=1.0, use_weight=True, adv_estimator="drgrpo"),
        # Options of the authors' code (src/pacs/pacs_core_algos.py) that the paper does not report (neither
        # v1's tables nor v2's text): pacs_beta1 with that one option changed, for exploration only.
        #   weight_mode (WEIGHT_MODE; compute_weight): "only_positive" w = y, "only_negative" w = 1 - y
        "pacs_beta1_only_positive": _pacs(beta=1.0, use_weight=True, weight_mode="only_positive"),
        "pacs_beta1_only_negative": _pacs(beta=1.0, use_weight=True, weight_mode="only_negative"),
        #   reward_method '2' (+actor_rollout_ref.pacs.reward_method; compute_reward): beta * mean log pi_theta
        #   over the response, no pi_old
        "pacs_beta1_reward2": _pacs(beta=1.0, use_weight=True, reward_method="2"),
        #   adv_estimator "naive" (ADV_ESTIMATOR; compute_naive_advantage): psi = r
        "pacs_beta1_naive_adv": _pacs(beta=1.0, use_weight=True, adv_estimator="naive"),
        # the authors' scripts/baseline/grpo.sh (verl 0.3.1)
        "grpo": Setup("grpo", _verl_actor(response_length), grad_clip=1.0),
        # the authors' scripts/baseline/ppo.sh: the actor's loss as GRPO's, on the GAE advantages of a critic
        # initialised from the same model (configs/ppo_trainer.yaml, ppo.sh's critic.optim.lr and
        # critic.ppo_micro_batch_size_per_gpu), its value loss aggregated as the actor's at verl's scale
        "ppo": Setup("ppo", _verl_actor(response_length), grad_clip=1.0,
                     critic=dict(lr=1e-5, clip_range_value=0.5, gamma=1.0, lam=1.0, loss_agg_mode="actor",
                                 loss_scale="verl", verl_micro_batch_size=8)),
        # PPO-clip 0.2 / dual clip 3 at token-mean, the critic at verl's defaults over the mini-batch
        "ppo_token_mean": Setup("ppo", dict(_CLIP, loss_agg_mode="token-mean"), grad_clip=1.0),
        "rloo": Setup("rloo", dict(_CLIP, loss_agg_mode="token-mean"), grad_clip=1.0),
        # GSPO (arXiv 2507.18071) as verl's examples/gspo_trainer: its sequence ratio clipped at 3e-4 / 4e-4,
        # seq-mean-token-mean (pinned), grad clip 1.0; CISPO (arXiv 2506.13585) as verl's
        # examples/cispo_trainer: no lower clip (clip_ratio_low 10), 0.2 above, token-mean. Both on GRPO's advantages.
        "gspo": Setup("gspo", dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4), grad_clip=1.0),
        "cispo": Setup("cispo", dict(clip_ratio_low=10.0, clip_ratio_high=0.2, loss_agg_mode="token-mean"),
                       grad_clip=1.0),
        "drgrpo": Setup("drgrpo", dict(_CLIP, loss_agg_mode="seq-mean-token-sum-norm", norm_length=response_length),
                        grad_clip=1.0),
    }


def setup(name: str, response_length: int) -> Setup:
    """The setup ``name`` at ``response_length``; ValueError names the known ones."""
    known = setups(response_length)
    if name not in known:
        raise ValueError(f"algorithm {name!r}: expected one of {sorted(known)}{did_you_mean(name, known)}")
    return known[name]
