"""Every PACS setup of configs/paper.py (the tables' PACS rows, the paper's ablations and the options of the
authors' code it does not report) selects the authors' formula for its options, shown on the trainer's own
loss and gradient (``loss_and_grad_fn`` as the update step builds it from the config) for a tiny real batch:
real DeepScaleR problems in the real Qwen chat template, responses scored by the authors' math-verify call
(``reward.mode`` "paper"), log-probs of a tiny random Qwen with the Qwen tokenizer cut to 4,096 entries
(conftest.py's small_tokenizer_dir: its BPE, chat template and special tokens) as its vocabulary and pi_old a
perturbed copy of it (a later mini-batch of a step). The reference is a float64 NumPy statement of the authors'
compute_pacs_loss (ritzz-ai/PACS src/pacs/pacs_core_algos.py) with log pi_theta from the model's logits in
float64. Each setup's loss equals its own formula and no other setup's; its gradient equals the backward
pass of the log-probs applied to the float64 formula's dL/dlogp. A second of CPU per setup: the cheap
stand-in for a shrunk training run per ablation (one of them, reward_method 2, also trains shrunk in
test_train_paper_setups.py).

The setups and the paper's sections, written out here rather than read from configs/paper.py:
arXiv 2509.02522v2 section 5.1 (beta in {0.1, 0.5, 1, 2, 10}, Figure 4), section 5.2 (the score function by
RLOO, GRPO's or Dr. GRPO's estimator, Appendix D.3, Tables 9-13), section 5.3 and v1 Table 2 (without
weights)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs.paper
from pacs_jax import models
from pacs_jax.data.prompts import load_tokenizer, render_prompt
from pacs_jax.rewards.paper import judge_paper
from pacs_jax.rl import options_for
from pacs_jax.rl.logprobs import response_logprobs
from pacs_jax.rl.loss_and_grad import loss_and_grad_fn
from pacs_jax.rl.update_batch import UpdateBatch
from pacs_jax.training.config_check import validate_config
from train_helpers import load_config

PACS_BETA1 = dict(beta=1.0, use_weight=True, weight_mode="question", reward_method="1", adv_estimator="rloo")
# ALGO: (its options over pacs_beta1, where the paper reports it: a section of v2, or None)
SETUPS = {
    "pacs_beta1": ({}, "4.1"),
    "pacs_beta1_noweight": (dict(use_weight=False), "5.3"),
    "pacs_beta0p1": (dict(beta=0.1), "5.1"),
    "pacs_beta0p5": (dict(beta=0.5), "5.1"),
    "pacs_beta2": (dict(beta=2.0), "5.1"),
    "pacs_beta10": (dict(beta=10.0), "5.1"),
    "pacs_beta1_grpo_adv": (dict(adv_estimator="grpo"), "5.2"),
    "pacs_beta1_drgrpo_adv": (dict(adv_estimator="drgrpo"), "5.2"),
    "pacs_beta2_noweight": (dict(beta=2.0, use_weight=False), None),
    "pacs_beta1_only_positive": (dict(weight_mode="only_positive"), None),
    "pacs_beta1_only_negative": (dict(weight_mode="only_negative"), None),
    "pacs_beta1_reward2": (dict(reward_method="2"), None),
    "pacs_beta1_naive_adv": (dict(adv_estimator="naive"), None),
}
OPTIONS = {name: dict(PACS_BETA1, **changed) for name, (changed, _) in SETUPS.items()}
N = 8  # the paper's responses per prompt
RESPONSE = 36  # response bucket (tokens): the longest response is 34 small-tokenizer tokens (24 real ones)
CORRECT = (3, 6, 0, 8)  # right answers of each prompt's 8: mixed groups either way, all wrong, all right


# ------------------------------------------------------------------------------------ the authors' formula
def authors_pacs_loss(logp, old_logp, mask, labels, n, *, beta, use_weight, weight_mode, reward_method,
                      adv_estimator) -> float:
    """float64 compute_pacs_loss over the response tokens: compute_reward (method '1': beta * sum(log pi -
    log pi_old); '2': beta * mean log pi), the score psi (rloo: r_i - mean of the others; grpo: (r - mean) /
    (torch's unbiased std + 1e-6); drgrpo: their grpo with norm_adv_by_std_in_grpo=False, r - mean, v2 eq.
    (10); naive: r), compute_weight (question: sklearn's "balanced" n / (2 * count) in mixed groups, else 1;
    only_positive: y; only_negative: 1 - y), BCEWithLogitsLoss(weight=w): the mean over responses."""
    logp, old_logp, mask, y = (np.asarray(a, np.float64) for a in (logp, old_logp, mask, labels))
    if reward_method == "1":
        r = beta * ((logp - old_logp) * mask).sum(-1)
    else:
        r = beta * (logp * mask).sum(-1) / mask.sum(-1)
    g = r.reshape(-1, n)
    centred = g - g.mean(1, keepdims=True)
    psi = {"rloo": g - (g.sum(1, keepdims=True) - g) / (n - 1), "grpo": centred / (g.std(1, ddof=1, keepdims=True) + 1e-6),
           "drgrpo": centred, "naive": g}[adv_estimator].reshape(-1)
    w = np.ones_like(y)
    if use_weight and weight_mode == "question":
        for start in range(0, len(y), n):
            group = y[start:start + n]
            if 0 < group.sum() < n:
                w[start:start + n] = n / (2.0 * np.where(group == 1, group.sum(), n - group.sum()))
    elif use_weight:
        w = y if weight_mode == "only_positive" else 1.0 - y
    return float(np.mean(w * (np.logaddexp(0.0, psi) - y * psi)))


def authors_dloss_dlogp(logp, old_logp, mask, labels, n, options) -> np.ndarray:
    """d authors_pacs_loss / d logp [B, R] by central differences in float64 (masked tokens only)."""
    logp = np.asarray(logp, np.float64)
    grad = np.zeros_like(logp)
    eps = 1e-6
    for i, t in zip(*np.nonzero(np.asarray(mask))):
        up, down = logp.copy(), logp.copy()
        up[i, t] += eps
        down[i, t] -= eps
        grad[i, t] = (authors_pacs_loss(up, old_logp, mask, labels, n, **options)
                      - authors_pacs_loss(down, old_logp, mask, labels, n, **options)) / (2 * eps)
    return grad


# ------------------------------------------------------------------------------------ a tiny real batch
@pytest.fixture(scope="module")
def batch(shared_data, small_tokenizer_dir):
    """The trainer's update batch (training/rollout.py's layout) for 4 real DeepScaleR problems x 8 responses,
    labels from the authors' scorer, log pi_old from a perturbed copy of the model; and the model."""
    tokenizer = load_tokenizer(small_tokenizer_dir)
    rows = json.loads((shared_data / "deepscaler_subset" / "math.json").read_text())
    rows = sorted((r for r in rows if (r["answer"] or "").isdigit()), key=lambda r: len(r["problem"]))[:len(CORRECT)]
    prompts, responses, labels = [], [], []
    for row, right in zip(rows, CORRECT):
        prompt = tokenizer(render_prompt(tokenizer, row["problem"]), add_special_tokens=False)["input_ids"]
        for j in range(N):
            answer = row["answer"] if j < right else str(int(row["answer"]) + j + 1)
            text = "Let me compute. " * (j % 4) + f"The answer is $\\boxed{{{answer}}}$."
            verdict = judge_paper(text, row["answer"])
            labels.append(verdict.score)
            prompts.append(prompt)
            responses.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    assert [sum(labels[i * N:(i + 1) * N]) for i in range(len(CORRECT))] == list(CORRECT)  # the scorer's labels
    P = max(map(len, prompts))
    assert max(map(len, responses)) <= RESPONSE
    ids = np.zeros((len(prompts), P + RESPONSE), np.int32)
    attention = np.zeros_like(ids)
    response_mask = np.zeros((len(prompts), RESPONSE), np.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P], attention[i, P - len(p):P] = p, 1  # prompt left-padded, response right-padded
        ids[i, P:P + len(r)], attention[i, P:P + len(r)], response_mask[i, :len(r)] = r, 1, 1
    cfg = models.QwenConfig(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            dtype="float32")
    graphdef, params = nnx.split(models.init_random(cfg, seed=0))
    noise = jax.tree.map(lambda x, k: 0.1 * jax.random.normal(k, x.shape, x.dtype), params,
                         jax.tree.unflatten(jax.tree.structure(params),
                                            list(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))))
    ids, attention = jnp.asarray(ids), jnp.asarray(attention)

    @jax.jit
    def logp_of(params):  # the trainer's log-prob path (pi_old after the rollout, pi_theta in the update)
        return response_logprobs(nnx.merge(graphdef, params), ids, attention, RESPONSE)

    old_logp = np.asarray(logp_of(jax.tree.map(jnp.add, params, noise)))
    # log pi_theta in float64 from the model's float32 logits, row by row (one row's [R, V] at a time)
    model = nnx.merge(graphdef, params)
    hidden = jax.jit(lambda: model(ids, attention, return_hidden=True)[:, P - 1:P - 1 + RESPONSE])()
    row_logits = jax.jit(model.logits)
    logp64 = np.zeros((len(ids), RESPONSE))
    for i in range(len(ids)):
        logits = np.asarray(row_logits(hidden[i:i + 1]), np.float64)[0]
        top = logits.max(-1, keepdims=True)
        logsumexp = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
        logp64[i] = logits[np.arange(RESPONSE), np.asarray(ids[i, P:])] - logsumexp
    update_batch = UpdateBatch(input_ids=ids, attention_mask=attention, response_mask=jnp.asarray(response_mask),
                               old_logp=jnp.asarray(old_logp), rewards=jnp.asarray(labels, jnp.float32))
    # the backward pass of the log-probs, for any cotangent dL/dlogp [B, R]
    backward = jax.jit(lambda params, cotangent: jax.vjp(logp_of, params)[1](cotangent)[0])
    return dict(batch=update_batch, logp64=logp64, old_logp=old_logp, mask=response_mask,
                labels=np.asarray(labels), graphdef=graphdef, params=params, backward=backward)


@pytest.fixture(scope="module")
def trained(batch, small_tokenizer_dir):
    """{ALGO: (its config, (loss, metrics, grads) of the trainer's loss_and_grad on the batch)}: each setup's
    config made valid on the test devices, and what the update step builds from it (objective, options, group
    size rollout.n, temperature; 2 micro-batches), all setups compiled as one program (one compilation, not
    13)."""
    built = {}
    for name in SETUPS:
        config = load_config("paper.py", f"qwen25_3b,{name}")
        config.model.random_init, config.data.tokenizer = True, str(small_tokenizer_dir)
        config.data.train_files = ("data/deepscaler_subset/math.json",)
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 8, 1
        validate_config(config)
        built[name] = (config, loss_and_grad_fn(batch["graphdef"], config.algorithm.objective,
                                                group_size=config.rollout.n, objective_options=options_for(config.algorithm),
                                                num_micro_batches=2, temperature=config.rollout.temperature))
    every = jax.jit(lambda params, update: {name: fn(params, update) for name, (_, fn) in built.items()})
    results = every(batch["params"], batch["batch"])
    return {name: (config, results[name]) for name, (config, _) in built.items()}


# ------------------------------------------------------------------------------------ tests
def test_the_named_pacs_setups_are_the_papers_and_the_authors_options():
    """configs/paper.py's ALGOs: these PACS setups (each pacs_beta1 with its options changed) and the two
    baselines, whose shrunk steps run in test_train_paper_setups.py (grpo) and test_train_ppo.py (ppo). Those the
    paper reports cite its section; the rest are marked as not in the paper. The ablation grids are the paper's:
    beta {0.1, 0.5, 1, 2, 10} (v2 section 5.1), score functions RLOO / GRPO / Dr. GRPO (v2 section 5.2)."""
    algorithms = configs.paper.ALGORITHMS
    others = set(configs.paper.OTHER_OBJECTIVES)
    assert others == {"gspo", "cispo"}
    assert len(set(algorithms)) == len(algorithms) and set(algorithms) == set(SETUPS) | {"grpo", "ppo"} | others
    sources, not_in_paper = configs.paper.PAPER_SOURCES, configs.paper.NOT_IN_PAPER
    assert set(sources) | set(not_in_paper) | others == set(algorithms) and not set(sources) & set(not_in_paper)
    for name, (_, section) in SETUPS.items():
        if section is None:
            assert name in not_in_paper, name
        else:
            assert name in sources and "v2" in sources[name], name
            if section != "4.1":
                assert f"section {section}" in sources[name], (name, sources[name])
    assert {OPTIONS[n]["beta"] for n, (_, s) in SETUPS.items() if s in ("4.1", "5.1")} == {0.1, 0.5, 1.0, 2.0, 10.0}
    assert {OPTIONS[n]["adv_estimator"] for n, (_, s) in SETUPS.items() if s in ("4.1", "5.2")} == {"rloo", "grpo",
                                                                                                  "drgrpo"}
    base = load_config("paper.py", "qwen25_7b,pacs_beta1").to_dict()
    for name in SETUPS:
        config = load_config("paper.py", f"qwen25_7b,{name}").to_dict()
        assert config.pop("workdir") == f"workdir/qwen25_7b_{name}"
        expected = {k: v for k, v in base.items() if k != "workdir"}
        expected["algorithm"] = dict(base["algorithm"], pacs=OPTIONS[name])
        assert config == expected, name  # nothing but the PACS options differs from pacs_beta1


def test_the_batch_tells_every_setup_apart(batch):
    """On this batch each setup's float64 loss is at least 0.5% away from every other's, so the check below
    (the trainer's loss within 2e-5 of its own formula) singles out one formula (pi_old is the model with
    normal(0, 0.1) noise on its weights: reward proxies of about +-1, psi of order 1)."""
    losses = {name: authors_pacs_loss(batch["logp64"], batch["old_logp"], batch["mask"], batch["labels"], N, **o)
              for name, o in OPTIONS.items()}
    values = sorted(losses.values())
    assert all(b - a > 0.005 * abs(b) for a, b in zip(values, values[1:])), losses


@pytest.mark.slow(seconds=5)  # each of the 13 setups: the file ~60 s, mostly the first setup's compilation
@pytest.mark.parametrize("name", list(SETUPS))
def test_each_pacs_setup_runs_the_authors_formula_for_its_options(batch, trained, name):
    """The trainer's loss for the setup's config is the authors' formula for its options and no other setup's;
    its gradient is the log-probs' backward pass of the formula's dL/dlogp."""
    config, (loss, _, grads) = trained[name]
    options = options_for(config.algorithm)
    assert config.algorithm.objective == "pacs" and options == OPTIONS[name]
    assert config.rollout.n == N and config.rollout.temperature == 1.0
    args = (batch["logp64"], batch["old_logp"], batch["mask"], batch["labels"], N)
    own = authors_pacs_loss(*args, **options)
    np.testing.assert_allclose(float(loss), own, rtol=2e-5, atol=1e-7)
    for other, other_options in OPTIONS.items():
        if other_options != options:
            assert abs(float(loss) - authors_pacs_loss(*args, **other_options)) > 0.005 * abs(own), other
    # the gradient: the float64 formula's dL/dlogp through the trainer's log-prob path
    dlogp = authors_dloss_dlogp(*args, options).astype(np.float32)
    expected = batch["backward"](batch["params"], jnp.asarray(dlogp))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max() + 1e-12, err_msg=name)
    assert max(np.abs(np.asarray(g)).max() for g in jax.tree.leaves(grads)) > 0


# ------------------------------------------------------------------------------------ published ablation rows
def _table_tool():
    import importlib.util

    from train_helpers import REPO

    spec = importlib.util.spec_from_file_location("_paper_table", REPO / "tools" / "paper_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_published_v2_rows_and_the_tool_name_each_setup_as_the_paper_does():
    """data/paper_results holds v2's Tables 2 and 6-8 (Qwen3-8B / 4B: Base, PPO, GRPO, PACS, w/o weight) and
    the score-function ablation of Appendix D.3 (Tables 9-13, Qwen3-4B), at v2's k = 1 ... 64 with BeyondAIME;
    tools/paper_table.py names a run of each setup as its published row (runs of the beta ablation, which v2
    shows only as a figure, by their beta) and lays a Qwen3-4B run out at that table's k."""
    tool = _table_tool()
    published = tool.load_published(tool.DEFAULT_PUBLISHED)
    sets = ["math_500", "amc23", "aime_2024", "aime_2025", "beyond_aime"]
    for model, methods in (("Qwen3-4B", ["Base", "PPO", "GRPO", "PACS", "PACS w/o weight", "PACS (adv_estimator=grpo)",
                                         "PACS (adv_estimator=drgrpo)"]),
                           ("Qwen3-8B", ["Base", "PPO", "GRPO", "PACS", "PACS w/o weight"])):
        table = published["tables"][model]
        assert list(table["rows"]) == methods and table["k"] == {s: [1, 4, 8, 16, 32, 64] for s in sets}
        for method, row in table["rows"].items():
            assert row["source"].startswith("arXiv 2509.02522v2, "), (model, method)
            for s in sets:
                assert row[s] == sorted(row[s]) and all(0 < v <= 100 for v in row[s]), (model, method, s)
        # v2 Table 1: PACS's average pass@1 over the five sets and its gain over the base model (the abstract's)
        pacs, base = (sum(table["rows"][m][s][0] for s in sets) / 5 for m in ("PACS", "Base"))
        assert (round(pacs, 2), round(pacs - base, 2)) == {"Qwen3-4B": (62.63, 8.26), "Qwen3-8B": (63.32, 9.57)}[model]
    rows = published["tables"]["Qwen3-4B"]["rows"]
    assert "Tables 9 (MATH 500)" in rows["PACS (adv_estimator=grpo)"]["source"]
    assert [rows[m]["beyond_aime"][i] for m in ("PACS", "PACS (adv_estimator=drgrpo)", "PACS (adv_estimator=grpo)")
            for i in (0, -1)] == [27.16, 62.10, 26.67, 60.36, 26.41, 56.30]  # Appendix D.3's text
    named = {}
    for name in SETUPS:
        config = load_config("paper.py", f"qwen3_4b,{name}")
        named[name] = tool.method_of({"algorithm": {"objective": "pacs", "options": options_for(config.algorithm)}})
    assert named["pacs_beta1"] == "PACS" and named["pacs_beta1_noweight"] == "PACS w/o weight"
    for name in ("pacs_beta1_grpo_adv", "pacs_beta1_drgrpo_adv"):
        assert named[name] in rows, name
    assert [named[n] for n in ("pacs_beta0p1", "pacs_beta0p5", "pacs_beta2", "pacs_beta10")] == [
        f"PACS (beta={b})" for b in (0.1, 0.5, 2.0, 10.0)]
    assert len(set(named.values())) == len(named)  # every setup its own row
    row = tool.Row.__new__(tool.Row)
    row.method, row.folder, row.preset = named["pacs_beta1_drgrpo_adv"], tool.REPO, "Qwen3-4B"
    row.metrics = {"aime_2024": {k: k / 100 for k in (1, 2, 4, 8, 16, 32)}}
    result = tool.build([row], published, tool.pick_model([row], None, published))
    assert result["source"] == "arXiv 2509.02522v2, Tables 6, 7 and 9-13 (Qwen3-4B)"
    by_set = {s["name"]: s for s in result["sets"]}
    assert list(by_set) == sets and by_set["beyond_aime"]["title"] == "BeyondAIME"
    ours = next(r for r in by_set["aime_2024"]["rows"] if r["method"] == "PACS (adv_estimator=drgrpo)")
    assert [tool.cell_text(c) for c in ours["cells"]] == [
        "1.00 / 55.78 (-54.78)", "4.00 / 71.54 (-67.54)", "8.00 / 76.28 (-68.28)", "16.00 / 81.27 (-65.27)",
        "32.00 / 82.89 (-50.89)", "— / 83.32"]  # k = 64 above the run's 32 samples
