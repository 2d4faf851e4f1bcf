"""PACS loss vs a float64 NumPy statement of docs/design.md section 6.1; its gradients; bad input."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax import rl
from pacs_jax.rl.pacs import pacs_loss


# ---------------------------------------------------------------- float64 NumPy reference

def ref_pacs(logp, old_logp, mask, rewards, n, *, beta=1.0, use_weight=True, weight_mode="question",
             reward_method="1", adv_estimator="rloo"):
    """Returns (loss, psi, weights), written response by response in float64."""
    logp, old_logp, mask = (np.asarray(a, np.float64) for a in (logp, old_logp, mask))
    y = np.asarray(rewards, np.float64)
    B = len(y)
    r = np.zeros(B)
    for i in range(B):
        if reward_method == "1":
            r[i] = beta * sum(logp[i, t] - old_logp[i, t] for t in range(logp.shape[1]) if mask[i, t])
        else:
            toks = [logp[i, t] for t in range(logp.shape[1]) if mask[i, t]]
            r[i] = beta * sum(toks) / len(toks)
    psi = np.zeros(B)
    w = np.ones(B)
    for start in range(0, B, n):
        group = list(range(start, start + n))
        rg = r[group]
        for k, i in enumerate(group):
            if adv_estimator == "rloo":
                psi[i] = rg[k] - sum(rg[j] for j in range(n) if j != k) / (n - 1)
            elif adv_estimator == "grpo":
                psi[i] = (rg[k] - rg.mean()) / (np.sqrt(((rg - rg.mean()) ** 2).sum() / (n - 1)) + 1e-6)
            else:
                psi[i] = rg[k]
        labels = [y[i] for i in group]
        for i in group:
            if not use_weight:
                w[i] = 1.0
            elif weight_mode == "only_positive":
                w[i] = 1.0 if y[i] == 1 else 0.0
            elif weight_mode == "only_negative":
                w[i] = 1.0 if y[i] == 0 else 0.0
            elif len(set(labels)) == 2:  # sklearn "balanced": n_samples / (n_classes * count)
                w[i] = n / (2 * labels.count(y[i]))
    bce = np.logaddexp(0.0, psi) - y * psi
    return float(np.mean(w * bce)), psi, w


def make_batch(seed, n, groups, T=11, all_equal_groups=(0,)):
    """Random log-probs, ragged masks (>= 1 token each), rewards; the listed groups get equal labels."""
    rs = np.random.RandomState(seed)
    B = n * groups
    logp = -rs.exponential(1.0, (B, T)).astype(np.float32)
    old_logp = (logp + 0.3 * rs.randn(B, T)).astype(np.float32)
    lengths = rs.randint(1, T + 1, B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = rs.randint(0, 2, B).astype(np.float32)
    for k, g in enumerate(all_equal_groups):  # the first is all correct, the next all wrong, ...
        rewards[g * n:(g + 1) * n] = (k + 1) % 2
    rewards[n:2 * n] = 0.0
    rewards[n] = 1.0  # group 1 is mixed with a single positive
    return logp, old_logp, mask, rewards


# Every value of every option: the reward methods x estimators with class-balanced weights, then the
# other weight modes (crossed with both reward methods) and non-default betas.
OPTIONS = [dict(reward_method=rm, adv_estimator=ae) for rm, ae in itertools.product(("1", "2"), ("rloo", "grpo", "naive"))]
OPTIONS += [dict(reward_method=rm, adv_estimator=ae, use_weight=uw, weight_mode=wm)
            for (rm, ae), (uw, wm) in zip((("1", "rloo"), ("2", "naive"), ("1", "grpo")),
                                          ((True, "only_positive"), (True, "only_negative"), (False, "question")))]
OPTIONS += [dict(beta=0.05), dict(reward_method="2", adv_estimator="grpo", beta=2.0)]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_pacs_matches_numpy_for_every_option(n):
    batch = make_batch(seed=n, n=n, groups=3, all_equal_groups=(0, 2))
    for opts in OPTIONS:
        want, want_psi, want_w = ref_pacs(*batch, n, **opts)
        got, metrics = pacs_loss(*map(jnp.asarray, batch), n, **opts)
        np.testing.assert_allclose(float(got), want, rtol=2e-5, atol=1e-6, err_msg=str(opts))
        np.testing.assert_allclose(float(metrics["pacs/psi_mean"]), want_psi.mean(), atol=2e-4, err_msg=str(opts))
        np.testing.assert_allclose(float(metrics["pacs/psi_std"]), want_psi.std(), rtol=1e-4, err_msg=str(opts))
        accuracy = np.mean((want_psi > 0) == (batch[3] > 0.5))
        np.testing.assert_allclose(float(metrics["pacs/accuracy"]), accuracy, err_msg=str(opts))
        for stat in ("mean", "min", "max"):
            np.testing.assert_allclose(float(metrics[f"pacs/weight_{stat}"]), getattr(np, stat)(want_w),
                                       rtol=1e-6, err_msg=str(opts))


def test_class_balanced_weights_by_hand():
    # n = 4: group 0 has one positive (weights 4/2 and 4/6), group 1 is all negative (weights 1).
    y = jnp.asarray([1.0, 0, 0, 0, 0, 0, 0, 0])
    logp = jnp.zeros((8, 3))
    _, metrics = pacs_loss(logp, logp, jnp.ones((8, 3)), y, 4)
    assert float(metrics["pacs/weight_max"]) == pytest.approx(2.0)
    assert float(metrics["pacs/weight_min"]) == pytest.approx(2.0 / 3.0)
    # every psi is 0 here, so the loss is mean(w) * log 2 with w = [2, 2/3, 2/3, 2/3, 1, 1, 1, 1].
    loss, _ = pacs_loss(logp, logp, jnp.ones((8, 3)), y, 4)
    assert float(loss) == pytest.approx((2 + 3 * 2 / 3 + 4) / 8 * np.log(2.0), rel=1e-6)


def test_gradient_wrt_psi_is_weighted_prediction_error():
    # reward method "1", naive estimator, beta 1, one token, old log-prob 0: psi_i = logp_i, so
    # d L / d logp_i0 is d L / d psi_i = w_i (sigmoid(psi_i) - y_i) / B.
    n, groups = 4, 3
    rs = np.random.RandomState(0)
    B = n * groups
    psi = rs.randn(B).astype(np.float32) * 2
    y = np.array([1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 0], np.float32)
    grad = jax.grad(lambda p: pacs_loss(p[:, None], jnp.zeros((B, 1)), jnp.ones((B, 1)), jnp.asarray(y), n,
                                        adv_estimator="naive")[0])(jnp.asarray(psi))
    _, _, w = ref_pacs(psi[:, None], np.zeros((B, 1)), np.ones((B, 1)), y, n, adv_estimator="naive")
    want = w * (1.0 / (1.0 + np.exp(-psi.astype(np.float64))) - y) / B
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n", [2, 8])
def test_gradient_wrt_token_logprobs_rloo(n):
    # d L / d logp_it = beta m_it (g_i - (1/(n-1)) sum_{j != i in group} g_j),  g = d L / d psi.
    beta = 0.7
    logp, old_logp, mask, y = make_batch(seed=3, n=n, groups=2)
    B = len(y)
    grad = jax.grad(lambda lp: pacs_loss(lp, jnp.asarray(old_logp), jnp.asarray(mask), jnp.asarray(y), n,
                                         beta=beta)[0])(jnp.asarray(logp))
    _, psi, w = ref_pacs(logp, old_logp, mask, y, n, beta=beta)
    g = w * (1.0 / (1.0 + np.exp(-psi)) - y) / B
    want = np.zeros_like(logp, dtype=np.float64)
    for i in range(B):
        group = range(i // n * n, i // n * n + n)
        coeff = g[i] - sum(g[j] for j in group if j != i) / (n - 1)
        want[i] = beta * mask[i] * coeff
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-4, atol=1e-7)
    assert np.all(np.asarray(grad)[mask == 0] == 0)  # padding gets no gradient


def test_micro_batch_totals_add_up_to_the_mini_batch_loss():
    n = 4
    logp, old_logp, mask, y = (jnp.asarray(a) for a in make_batch(seed=5, n=n, groups=4))
    full, _ = pacs_loss(logp, old_logp, mask, y, n)
    totals = rl.BatchTotals(num_sequences=len(y), num_tokens=jnp.sum(mask))
    parts = [pacs_loss(logp[s:s + 2 * n], old_logp[s:s + 2 * n], mask[s:s + 2 * n], y[s:s + 2 * n], n,
                       totals=totals)[0] for s in (0, 2 * n)]
    np.testing.assert_allclose(float(sum(parts)), float(full), rtol=1e-6)


def test_jit_matches_eager():
    n = 4
    batch = [jnp.asarray(a) for a in make_batch(seed=9, n=n, groups=2)]
    eager, _ = pacs_loss(*batch, n)
    jitted, _ = jax.jit(lambda *b: pacs_loss(*b, n))(*batch)
    np.testing.assert_allclose(float(jitted), float(eager), rtol=1e-6)


@pytest.mark.parametrize("change, message", [
    (dict(rewards=np.array([1, 0, 0.5, 1], np.float32)), "rewards must be 0 or 1"),
    (dict(rewards=np.array([1, 0, 2, 1], np.float32)), "rewards must be 0 or 1"),
    (dict(rewards=np.ones(3, np.float32)), "rewards must be"),
    (dict(old_logp=np.zeros((4, 4), np.float32)), "old_logp must have logp's shape"),
    (dict(response_mask=np.ones((4, 6), np.float32)), "response_mask must have logp's shape"),
    (dict(response_mask=np.full((4, 5), 2.0, np.float32)), "response_mask must hold only 0 and 1"),
    (dict(group_size=3), "not divisible by group_size=3"),
    (dict(group_size=1), "group_size=1"),
    (dict(logp=np.zeros((4,), np.float32)), "logp must be"),
])
def test_bad_input_raises_before_tracing(change, message):
    args = dict(logp=np.zeros((4, 5), np.float32), old_logp=np.zeros((4, 5), np.float32),
                response_mask=np.ones((4, 5), np.float32), rewards=np.array([1, 0, 0, 1], np.float32),
                group_size=2)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        rl.get_objective("pacs")(**args)


def test_bad_shapes_raise_inside_jit_and_bad_options_raise():
    with pytest.raises(ValueError, match="not divisible by group_size=4"):
        jax.jit(lambda lp: rl.get_objective("pacs")(lp, lp, jnp.ones_like(lp), jnp.zeros(6), 4)[0])(jnp.zeros((6, 3)))
    for bad, message in ((dict(reward_method="3"), "reward_method"), (dict(weight_mode="x"), "weight_mode"),
                         (dict(adv_estimator="ppo"), "adv_estimator")):
        with pytest.raises(ValueError, match=message):
            rl.get_objective("pacs", **bad)
    with pytest.raises(ValueError, match="objective .pacs.: no option"):
        rl.get_objective("pacs", kl_coef=0.1)
    with pytest.raises(ValueError, match="objective='ppo2'"):
        rl.get_objective("ppo2")
