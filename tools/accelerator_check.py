"""Run this first on new hardware: does the GPU / TPU path hold here, and how fast is it?

    python tools/accelerator_check.py                 # on a GPU or TPU host: a few minutes
    python tools/accelerator_check.py --size=tiny     # any machine, the CPU included: tiny shapes (CI runs this)
    python tools/accelerator_check.py --only=decode,sampling --out=check.json

Runs the project's own tools, each in its own process (a crash or a hang in one is reported, the others
still run), on random weights of the Qwen2.5-1.5B preset in bfloat16 (``--size=tiny``: one layer of
Qwen2.5-0.5B, a two-layer model of 64 wide for the trainer, float32, tiny batches):

    decode     tools/bench_decode.py at two fills: a short one (the decode step's fixed cost) and a long
               one whose page table is not a power of 2 pages wide (132 pages: the width the library's
               GPU kernel could not lower); the step's time and its share of the measured copy rate
    sampling   tools/bench_sampling.py --compare: static, continuous and paged samplers on the same rows
               (tokens/s, slot utilisation; how many tokens paged and continuous sample differently from
               static, and where rows first diverge)
    update     tools/bench_update.py --packing: packed against padded passes of one PACS step (tokens
               computed and time, padded / packed)
    train      two steps of the trainer (python -m pacs_jax.train), once with the paged sampler and once
               with the continuous one: the sampler's log-probs against the trainer's (pi_old) on the
               same tokens, ``rollout_logprob_diff_mean`` / ``_max`` and ``rollout_kl`` (metrics.jsonl)

then prints one table (check, status, seconds, figures) and exits 1 if any check crashed, timed out or
printed no figures. Each check's full output goes to ``--logs`` (default: a temporary folder, named in
the table). The device and the peak rates measured beside each figure are in each tool's own lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"


@dataclasses.dataclass(frozen=True)
class Check:
    """One check: its name, the command (argv, run in the repository), the figures read from its
    output (name -> regex with one group), a time limit in seconds, and a metrics.jsonl whose last row
    is read as output too (a trainer run's)."""

    name: str
    argv: tuple[str, ...]
    figures: dict
    timeout: float
    metrics: pathlib.Path | None = None


def _train_argv(size: str, sampler: str, workdir: pathlib.Path) -> tuple[str, ...]:
    """Two trainer steps of the paper's Qwen2.5 setup (PACS, beta 1) shrunk to one device and the
    data shipped in the repository; random weights."""
    prompts, new, model = (2, 8, ["--config.model.preset=", "--config.model.hidden_size=64",
                                   "--config.model.intermediate_size=128", "--config.model.num_hidden_layers=2",
                                   "--config.model.num_attention_heads=4", "--config.model.num_key_value_heads=2",
                                   "--config.model.head_dim=16", "--config.model.vocab_size=151936",
                                   "--config.model.model_type=qwen2", "--config.model.rope_theta=1000000.0",
                                   "--config.model.dtype=float32"]) \
        if size == "tiny" else (16, 512, ["--config.model.preset=Qwen2.5-1.5B"])
    return (sys.executable, "-m", "pacs_jax.train", "--config=configs/paper.py:qwen25_3b,pacs_beta1",
            f"--workdir={workdir}", "--config.model.random_init=True", *model,
            "--config.data.tokenizer=data/tokenizers/qwen3", "--config.data.tokenizer_force=True",
            "--config.data.train_files=('data/deepscaler_subset/math.json',)",
            "--config.data.max_prompt_length=256", "--config.data.prompt_buckets=(256,)",
            "--config.mesh.data=1", "--config.mesh.fsdp=1", "--config.mesh.tensor=1",
            f"--config.train.prompts_per_step={prompts}", "--config.train.steps=2", "--config.train.mini_batches=1",
            "--config.train.micro_batches=1", "--config.train.logprob_micro_batches=1",
            f"--config.rollout.max_new_tokens={new}", f"--config.rollout.response_buckets=({new},)",
            "--config.rollout.micro_batches=1", f"--config.rollout.sampler={sampler}",
            f"--config.rollout.slots={prompts * 8}", f"--config.rollout.tail_slots={max(prompts, 8)}",
            "--config.eval.before_rl=False", "--config.eval.sets=", "--config.eval.periodic.every=0",
            "--config.train.checkpoint_every=0")


def checks(size: str, workdir: pathlib.Path) -> list[Check]:
    """The checks at ``size`` ("tiny": any machine; "full": the sizes an accelerator is judged at)."""
    py = sys.executable
    if size == "tiny":
        model = ("--preset=Qwen2.5-0.5B", "--layers=1")
        decode = (*model, "--dtype=float32", "--slots=4", "--steps=2", "--rounds=1", "--copy-mb=16")
        fills = (16, 48)
        sampling = (*model, "--dtypes=float32", "--batch=4", "--n=2", "--slots=4", "--tail-slots=2", "--new=16",
                    "--prompt=16")
        update = ("--preset=", "--prompts=2", "--budget=64")
        limit = 900
    else:
        model = ("--preset=Qwen2.5-1.5B",)
        decode = (*model, "--dtype=bfloat16", "--slots=256", "--steps=64", "--rounds=2")
        fills = (64, 2048)
        sampling = (*model, "--dtypes=bfloat16", "--batch=64", "--n=8", "--slots=256", "--tail-slots=32",
                    "--new=1024", "--prompt=256")
        update = (*model, "--prompts=8", "--budget=1024", "--micro-batches=4")
        limit = 600
    step = {"decode step ms": r"decode step (-?[\d.]+) ms", "of copy rate": r"(-?[\d.]+) of the measured copy"}
    differ = {"paged tok/s ratio": r"paged vs static: .*tokens/s ratio ([\d.]+)",
              "continuous differing %": r"continuous vs static: differing tokens ([\d.]+) %",
              "paged differing %": r"paged vs static: differing tokens ([\d.]+) %",
              "paged first diverge (median)": r"paged vs static: differing.*at token \d+ \.\. (\d+) \.\.",
              "continuous first diverge (median)": r"continuous vs static: differing.*at token \d+ \.\. (\d+) \.\."}
    consistency = {"rollout_logprob_diff_mean": r'"rollout_logprob_diff_mean": ([-\d.e]+)',
                   "rollout_logprob_diff_max": r'"rollout_logprob_diff_max": ([-\d.e]+)',
                   "rollout_kl": r'"rollout_kl": ([-\d.e]+)'}
    out = [Check(f"decode fill {fill}", (py, str(TOOLS / "bench_decode.py"), *decode, f"--fill={fill}"), step, limit)
           for fill in fills]
    out.append(Check("sampling", (py, str(TOOLS / "bench_sampling.py"), "--compare", *sampling), differ, limit))
    out.append(Check("update packed vs padded", (py, str(TOOLS / "bench_update.py"), "--packing", *update),
                     {"tokens ratio": r"tokens computed ratio ([\d.]+)", "time ratio": r"time ratio ([\d.]+)",
                      "loss diff": r"loss difference ([-\d.e]+)"}, limit))
    for sampler in ("paged", "continuous"):
        run = workdir / f"train_{sampler}"
        out.append(Check(f"train 2 steps ({sampler})", _train_argv(size, sampler, run), consistency, limit,
                         metrics=run / "metrics.jsonl"))
    return out


def run_check(check: Check, log: pathlib.Path) -> dict:
    """Run one check; its output to ``log``. Returns {status, seconds, figures}: status "ok", "crashed
    (status N)", "timed out" or "no figures"."""
    start = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run(check.argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=check.timeout)
        text, status = done.stdout, ("ok" if done.returncode == 0 else f"crashed (status {done.returncode})")
    except subprocess.TimeoutExpired as e:
        text, status = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timed out"
    if check.metrics is not None and check.metrics.exists():  # the figures are the last step's metrics
        lines = check.metrics.read_text().splitlines()
        text += "\n" + (lines[-1] if lines else "")
    log.write_text(text)
    figures = {}
    for name, pattern in check.figures.items():
        found = re.findall(pattern, text)
        if found:
            figures[name] = float(found[-1])
    if status == "ok" and not figures:
        status = "no figures"
    last = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    return {"status": status, "seconds": round(time.perf_counter() - start, 1), "figures": figures,
            "last_line": "" if status == "ok" else last[:200], "log": str(log)}


def table(results: dict) -> str:
    lines = [f"{'check':<28}{'status':<22}{'seconds':>8}  figures"]
    for name, r in results.items():
        figures = ", ".join(f"{k} {v:g}" for k, v in r["figures"].items()) or r["last_line"] or "-"
        lines.append(f"{name:<28}{r['status']:<22}{r['seconds']:>8.1f}  {figures}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("full", "tiny"), default="full",
                        help="full: the sizes an accelerator is judged at (default); tiny: any machine, seconds")
    parser.add_argument("--only", default="", help="comma-separated check names' starts (decode, sampling, update, "
                                                   "train); default all")
    parser.add_argument("--logs", default="", help="folder for each check's output (default: a temporary one)")
    parser.add_argument("--out", default="", help="also write the results as JSON to this file (after each check)")
    args = parser.parse_args(argv)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    chosen = lambda logs: [c for c in checks(args.size, logs)  # noqa: E731
                           if not wanted or any(c.name.startswith(w) for w in wanted)]
    if not chosen(pathlib.Path(".")):  # before anything is written
        parser.error(f"--only={args.only}: no check starts with that (decode, sampling, update, train)")
    logs = pathlib.Path(args.logs or tempfile.mkdtemp(prefix="accelerator_check_"))
    logs.mkdir(parents=True, exist_ok=True)
    selected = chosen(logs)
    results = {}
    for check in selected:
        print(f"[accelerator_check] {check.name} ...", flush=True)
        results[check.name] = run_check(check, logs / (re.sub(r"\W+", "_", check.name).strip("_") + ".log"))
        print(f"[accelerator_check] {check.name}: {results[check.name]['status']} "
              f"({results[check.name]['seconds']:.0f} s)", flush=True)
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"logs: {logs}")
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
