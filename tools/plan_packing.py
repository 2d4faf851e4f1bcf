"""How much of a paper step's pi_old and update is real work, packed and padded? Plans the packing of
simulated steps on the host, as the trainer plans it, and prints the passes and the efficiency.

    python tools/plan_packing.py                      # every paper model (configs/paper.py) on its slice
    python tools/plan_packing.py --config=configs/paper.py:qwen3_8b,ppo --topology=v5p-64 --median 700

A step is shaped like the paper's: the config's prompts_per_step prompts drawn from the DeepScaleR
problems shipped in data/ (deepscaler_subset/math.json) in the chat template of the Qwen tokenizer
in data/tokenizers/qwen3, rollout.n responses each whose lengths are log-normal (median ``--median``,
default max_new_tokens / 8, sigma 1) clipped to max_new_tokens. The plan is the trainer's own
(training/spec.py ``RunSpec.packed_layouts`` on the config's mesh over the slice's devices,
rl/packing.py ``plan_packing``), so nothing here compiles or runs a model. For each pass it prints the
packed rows of a pass and shard, the passes a mini-batch took and the planning time; then per step
    packing_efficiency P (padded R): tokens computed ratio X
where P and R are real / computed tokens of pi_old and the update (PPO: and the critic's two passes)
as the trainer's metric counts them, packed and padded (every row the prompt bucket of the step's
longest prompt + the response bucket of its longest response, as the padded trainer runs them).
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import time
from collections.abc import Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from pacs_jax import data  # noqa: E402
from pacs_jax.rl.packing import plan_packing  # noqa: E402
from pacs_jax.topologies import get_topology  # noqa: E402
from pacs_jax.training.engine.collect import pick_bucket  # noqa: E402
from pacs_jax.training.spec import RunSpec  # noqa: E402

PAPER = {"qwen25_3b": "v5p-64", "qwen25_7b": "v5p-64", "qwen3_4b": "v5p-64", "qwen3_8b": "v5p-64",
         "qwen25_7b_v6e": "v6e-64"}  # configs/paper.py's models and the slices they are sized for


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=[],
                        help="a config (PATH:ARG), repeatable (default: every paper model with pacs_beta1)")
    parser.add_argument("--topology", default="",
                        help="the slice (pacs_jax/topologies.py; default: the paper model's, else v5p-64)")
    parser.add_argument("--median", type=float, default=0, help="median response length (default: max_new_tokens / 8)")
    parser.add_argument("--steps", type=int, default=2, help="simulated steps per config (default: 2)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load_config(spec: str):
    """The config of ``PATH[:ARG]`` (a configs/ file's get_config), as the trainer's --config loads it."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_plan_packing_config", REPO / path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def prompt_lengths(count: int, rs: np.random.RandomState, max_length: int) -> np.ndarray:
    """Token counts of ``count`` DeepScaleR problems in the Qwen chat template."""
    tokenizer = data.load_tokenizer(str(REPO / "data/tokenizers/qwen3"))
    problems, _ = data.load_problems(str(REPO / "data/deepscaler_subset/math.json"), on_error="skip")
    chosen = [problems[i] for i in rs.choice(len(problems), count + count // 8, replace=False)]
    examples, _ = data.build_prompts(chosen, tokenizer, max_length)
    if len(examples) < count:
        raise SystemExit(f"only {len(examples)} of the drawn problems fit {max_length} prompt tokens")
    return np.asarray([len(e.prompt_ids) for e in examples[:count]])


def response_lengths(count: int, rs: np.random.RandomState, median: float, budget: int) -> np.ndarray:
    """``count`` response lengths, log-normal (median ``median``, sigma 1) rounded and clipped to ``budget``."""
    return np.minimum(np.round(rs.lognormal(np.log(median), 1.0, count)), budget).astype(np.int64)


def plan_config(spec: str, topology: str, args: argparse.Namespace, rs: np.random.RandomState) -> None:
    run = RunSpec.from_config(load_config(spec), get_topology(topology).num_devices)
    tc, rc, devices, shards = run.train, run.rollout, run.devices, run.batch_shards
    layouts = run.packed_layouts(shards, critic=run.critic is not None)
    buckets, budget = list(run.data.prompt_buckets), rc.max_new_tokens
    response_buckets = list(rc.buckets)
    median = args.median or budget / 8
    print(f"{spec} on {topology} ({devices} devices, {shards} batch shards): {tc.prompts_per_step} prompts x "
          f"{rc.n} responses, prompt buckets {buckets}, budget {budget}, responses log-normal (median {median:.0f}, "
          f"sigma 1)", flush=True)
    for step in range(args.steps):
        prompts = np.repeat(prompt_lengths(tc.prompts_per_step, rs, buckets[-1]), rc.n)
        responses = response_lengths(len(prompts), rs, median, budget)
        real = int(prompts.sum() + responses.sum())
        width = (pick_bucket(int(prompts.max()), buckets, "a prompt")
                 + pick_bucket(int(responses.max()), response_buckets, "a response"))
        computed, lines = {}, []
        for name, layout in layouts.items():
            t0 = time.perf_counter()
            plan = plan_packing(prompts, responses, prompt_width=buckets[-1], response_width=budget,
                                packed_length=tc.packed_length or buckets[-1] + budget, **layout.options())
            seconds = time.perf_counter() - t0
            computed[name] = plan.tokens_computed
            lines.append(f"  {name:8s} {layout.rows} packed rows a pass and shard, passes {list(plan.passes)} "
                         f"of at most {layout.passes} (efficiency {real / plan.tokens_computed:.3f}; planned in "
                         f"{seconds:.2f} s)")
        passes = 2 if layouts.critic is None else 4  # pi_old and the update; PPO: the critic's values and update
        packed = computed["logprob"] * (passes // 2) + computed["update"] + computed.get("critic", 0)
        padded = passes * len(prompts) * width
        print(f"step {step + 1}: {real} real tokens, longest response {responses.max()}, padded rows of {width}")
        print("\n".join(lines))
        print(f"  packing_efficiency {passes * real / packed:.3f} (padded {passes * real / padded:.3f}): "
              f"tokens computed ratio {padded / packed:.2f}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    specs = args.config or [f"configs/paper.py:{model},pacs_beta1" for model in PAPER]
    rs = np.random.RandomState(args.seed)
    for spec in specs:
        model = spec.partition(":")[2].partition(",")[0]
        try:
            plan_config(spec, args.topology or PAPER.get(model, "v5p-64"), args, rs)
        except (ValueError, OSError) as error:  # an unknown topology or config argument, a missing file
            print(f"plan_packing: {spec}: {error}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    from pacs_jax.cpu_host import use_cpu_without_accelerator

    use_cpu_without_accelerator()  # libtpu's start-up lines on a host without a TPU (pacs_jax/cpu_host.py)
    sys.exit(main())
