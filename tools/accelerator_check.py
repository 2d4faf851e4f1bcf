"""Run this first on new hardware: does the GPU / TPU path hold here, and how fast is it?

    python tools/accelerator_check.py                 # on a GPU or TPU host: a few minutes
    python tools/accelerator_check.py --size=tiny     # any machine, the CPU included: tiny shapes (CI runs this)
    python tools/accelerator_check.py --only=decode,sampling --out=check.json
    python tools/accelerator_check.py --size=tiny --tokenizer=DIR     # the trainer checks on DIR's tokenizer

Runs the project's own tools, each in its own process (a crash or a hang in one is reported, the others
still run), on random weights of the Qwen2.5-1.5B preset in bfloat16 (``--size=tiny``: one layer of
Qwen2.5-0.5B with 4,096 vocabulary entries, a two-layer model of 64 wide for the trainer, float32, tiny batches):

    decode     tools/bench_decode.py at two fills: a short one (the decode step's fixed cost) and a long
               one whose page table is not a power of 2 pages wide (132 pages: the width the library's
               GPU kernel could not lower); the step's time and its share of the measured copy rate; at
               the full size the short fill again with XLA:GPU's split-K of the gemms off
               (XLA_FLAGS=--xla_gpu_experimental_force_split_k=1: which is faster on this GPU)
    sampling   tools/bench_sampling.py --compare: static, continuous and paged samplers on the same rows
               (tokens/s, slot utilisation; how many tokens paged and continuous sample differently from
               static, and where rows first diverge)
    update     tools/bench_update.py --packing: packed against padded passes of one PACS step (tokens
               computed and time, padded / packed)
    train      two steps of the trainer (python -m pacs_jax.train), once with the paged sampler and once
               with the continuous one: the sampler's log-probs against the trainer's (pi_old) on the
               same tokens, ``rollout_logprob_diff_mean`` / ``_max`` and ``rollout_kl`` (metrics.jsonl)

and, on a GPU that pacs_jax/topologies.py knows as a one-device topology (an H200: h200x1, an H100:
h100x1),

    plan       tools/plan_step.py --topology=that one for the trainer check's shape (its config, every
               response at its budget, as random weights run): each phase's predicted seconds at its
               bound's peak, compiled for that GPU on this host's CPU

then prints one table (check, status, seconds, figures), then plan_step's prediction beside each phase
the paged trainer check measured in its second step (sampling against prefill + decode, pi_old,
update, the step; predicted / measured: how close the GPU runs to its bounds, where time goes; the
step's reward scoring, overlapped with pi_old, is not predicted), or why there is none, and exits 1
if any check crashed, timed out or printed no figures. The first line says which backend jax finds (asked in a process of its own, so that
this one holds no accelerator the checks need); on a host without an accelerator (jax's default backend
is the CPU) the full size is refused, one line naming ``--size=tiny``, exit status 78
(pacs_jax/errors.py): its shapes would run a CPU out of memory for an hour. A figure that could not be
measured (a step time not positive, a share of the copy rate outside [0, 1]) is "n/a". Each check runs
in a process group of its own, killed whole when the check times out, fails or is stopped (Ctrl-C,
SIGTERM): no process outlives the check. Each check's full output goes to ``--logs`` (default: a
temporary folder, deleted when every check passed unless ``--keep_logs``; kept and named otherwise).
The device and the peak rates measured beside each figure are in each tool's own lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
if str(REPO) not in sys.path:  # pacs_jax.errors, when run as a script from anywhere
    sys.path.insert(0, str(REPO))
from pacs_jax.errors import UsageError, run_main  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Check:
    """One check: its name, the command (argv, run in the repository), the figures read from its
    output (name -> regex with one group), a time limit in seconds, a metrics.jsonl whose last row
    is read as output too (a trainer run's), and environment variables of its own."""

    name: str
    argv: tuple[str, ...]
    figures: dict
    timeout: float
    metrics: pathlib.Path | None = None
    env: tuple[tuple[str, str], ...] = ()  # (variable, value) pairs added to the tool's environment


def _train_argv(size: str, sampler: str, workdir: pathlib.Path, tokenizer: str = "") -> tuple[str, ...]:
    """Two trainer steps of the paper's Qwen2.5 setup (PACS, beta 1) shrunk to one device and the
    data shipped in the repository; random weights."""
    return (sys.executable, "-m", "pacs_jax.train", *_config_argv(size, sampler, tokenizer), f"--workdir={workdir}")


def _train_shape(size: str, tokenizer: str = "") -> tuple[int, int, list[str]]:
    """The trainer check's prompts a step, new tokens and model flags at ``size`` (tiny: Qwen's 151,936-entry
    vocabulary, or with ``tokenizer`` that folder's)."""
    if size == "tiny":
        vocab = 0 if tokenizer else 151936  # 0: the tokenizer's
        return 2, 8, ["--config.model.preset=", "--config.model.hidden_size=64", "--config.model.intermediate_size=128",
                      "--config.model.num_hidden_layers=2", "--config.model.num_attention_heads=4",
                      "--config.model.num_key_value_heads=2", "--config.model.head_dim=16",
                      f"--config.model.vocab_size={vocab}", "--config.model.model_type=qwen2",
                      "--config.model.rope_theta=1000000.0", "--config.model.dtype=float32"]
    return 16, 512, ["--config.model.preset=Qwen2.5-1.5B"]


def _config_argv(size: str, sampler: str, tokenizer: str = "") -> tuple[str, ...]:
    """The trainer check's config flags (the paper's Qwen2.5 setup shrunk to one device and the data
    shipped in the repository, the tokenizer ``tokenizer`` or the repository's Qwen one; random weights)."""
    prompts, new, model = _train_shape(size, tokenizer)
    return ("--config=configs/paper.py:qwen25_3b,pacs_beta1", "--config.model.random_init=True", *model,
            f"--config.data.tokenizer={tokenizer or 'data/tokenizers/qwen3'}", "--config.data.tokenizer_force=True",
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


# XLA:GPU splits the decode step's 256-row gemms 8 ways by a shape heuristic (float32 partials written and
# reduced: 1.5 GB of the issue 52 step's 14.74 compiled); whether the step is faster without is the device's to say
SPLIT_K_1 = ("XLA_FLAGS", "--xla_gpu_experimental_force_split_k=1")
PREDICTED = {"prefill s": r"(?m)^prefill +(?:\S+ +){9}([\d.]+)", "decode s": r"(?m)^decode +(?:\S+ +){9}([\d.]+)",
             "pi_old s": r"(?m)^pi_old +(?:\S+ +){9}([\d.]+)", "update s": r"(?m)^update +(?:\S+ +){9}([\d.]+)",
             "step s": r"(?m)^step: ([\d.]+) s predicted"}
# (phase, the plan's figures summed, the paged trainer check's metric in its last step)
COMPARED = (("sampling", ("prefill s", "decode s"), "time_sample"), ("pi_old", ("pi_old s",), "time_old_logprob"),
            ("update", ("update s",), "time_update"), ("step", ("step s",), "time_step"))


def plan_checks(size: str, topology: str | None, tokenizer: str = "") -> list[Check]:
    """The plan check (tools/plan_step.py for the paged trainer check's shape on ``topology``), or none
    without a topology."""
    if topology is None:
        return []
    argv = (sys.executable, str(TOOLS / "plan_step.py"), f"--topology={topology}", "--lengths=budget",
            *_config_argv(size, "paged", tokenizer))
    return [Check("plan (predicted)", argv, PREDICTED, 900)]


def local_topology(timeout: float = 300) -> tuple[str | None, str]:
    """(the one-device GPU topology of pacs_jax/topologies.py whose device is this host's first, or
    None; that device's kind), asked in a process of its own."""
    from pacs_jax.topologies import TOPOLOGIES

    with tempfile.TemporaryFile("w+") as out:
        status = run_group((sys.executable, "-c", "import jax; print(jax.devices()[0].device_kind)"), out, timeout)
        out.seek(0)
        lines = out.read().strip().splitlines()
    kind = lines[-1].strip() if status == 0 and lines else "unknown"
    return next((t.name for t in TOPOLOGIES.values() if t.platform == "gpu" and t.devices == 1
                 and t.device_kind == kind), None), kind


def comparison(results: dict, why_none: str) -> str:
    """plan_step's predicted seconds beside the paged trainer check's measured ones, phase by phase:
    "phase  predicted s  measured s  predicted/measured"; ``why_none`` when there is no prediction."""
    plan, train = (results.get(name, {}).get("figures", {}) for name in ("plan (predicted)", "train 2 steps (paged)"))
    if not plan:
        return f"predicted: {why_none}"
    number = lambda x: f"{x:.2f}" if isinstance(x, float) else "n/a"  # noqa: E731
    lines = [f"{'phase':<12}{'predicted s':>12}{'measured s':>12}  predicted/measured"]
    for phase, parts, metric in COMPARED:
        predicted = sum(plan[p] for p in parts) if all(isinstance(plan.get(p), float) for p in parts) else None
        measured = train.get(metric)
        ratio = predicted / measured if predicted is not None and isinstance(measured, float) and measured > 0 else None
        lines.append(f"{phase:<12}{number(predicted):>12}{number(measured):>12}  {number(ratio)}")
    return "\n".join(lines)


def checks(size: str, workdir: pathlib.Path, tokenizer: str = "") -> list[Check]:
    """The checks at ``size`` ("tiny": any machine; "full": the sizes an accelerator is judged at); the trainer
    checks' tokenizer folder ``tokenizer`` ("": the repository's Qwen one)."""
    py = sys.executable
    if size == "tiny":
        # random weights and random prompts: a vocabulary of 4,096 entries checks the same code as Qwen's 151,936,
        # whose embedding and head were a fifth of these three checks' CPU time (88 -> 67 s here)
        model = ("--preset=Qwen2.5-0.5B", "--layers=1", "--vocab=4096")
        decode = (*model, "--dtype=float32", "--slots=4", "--steps=16", "--rounds=2", "--copy-mb=16")
        fills = (16, 48)
        sampling = (*model, "--dtypes=float32", "--batch=4", "--n=2", "--slots=4", "--tail-slots=2", "--new=16",
                    "--prompt=16")
        update = ("--preset=", "--prompts=2", "--budget=16", "--dtype=float32")
        limit = 900
    else:
        model = ("--preset=Qwen2.5-1.5B",)
        decode = (*model, "--dtype=bfloat16", "--slots=256", "--steps=64", "--rounds=2")
        fills = (64, 2048)
        sampling = (*model, "--dtypes=bfloat16", "--batch=64", "--n=8", "--slots=256", "--tail-slots=32",
                    "--new=1024", "--prompt=256")
        update = (*model, "--prompts=8", "--budget=1024", "--micro-batches=4")
        limit = 600
    step = {"decode step ms": r"decode step ([\d.]+ ms|n/a)",
            "of copy rate": r"([\d.]+|n/a)(?: \([^)]*\))? of the measured copy"}
    differ = {"paged tok/s ratio": r"paged vs static: .*tokens/s ratio ([\d.]+)",
              "continuous differing %": r"continuous vs static: differing tokens ([\d.]+) %",
              "paged differing %": r"paged vs static: differing tokens ([\d.]+) %",
              "paged first diverge (median)": r"paged vs static: differing.*at token \d+ \.\. (\d+) \.\.",
              "continuous first diverge (median)": r"continuous vs static: differing.*at token \d+ \.\. (\d+) \.\."}
    consistency = {"rollout_logprob_diff_mean": r'"rollout_logprob_diff_mean": ([-+\d.e]+)',
                   "rollout_logprob_diff_max": r'"rollout_logprob_diff_max": ([-+\d.e]+)',
                   "rollout_kl": r'"rollout_kl": ([-+\d.e]+)',
                   **{metric: rf'"{metric}": ([\d.e+-]+)' for _, _, metric in COMPARED}}
    out = [Check(f"decode fill {fill}", (py, str(TOOLS / "bench_decode.py"), *decode, f"--fill={fill}"), step, limit)
           for fill in fills]
    if size == "full":  # XLA:GPU's split-K of the decode gemms against none (docs/design.md 3.2; a TPU ignores it)
        out.insert(1, dataclasses.replace(out[0], name=f"decode fill {fills[0]}, split_k 1", env=(SPLIT_K_1,)))
    out.append(Check("sampling", (py, str(TOOLS / "bench_sampling.py"), "--compare", *sampling), differ, limit))
    out.append(Check("update packed vs padded", (py, str(TOOLS / "bench_update.py"), "--packing", *update),
                     {"tokens ratio": r"tokens computed ratio ([\d.]+)", "time ratio": r"time ratio ([\d.]+)",
                      "loss diff": r"loss difference ([-+\d.e]+)"}, limit))
    for sampler in ("paged", "continuous"):
        run = workdir / f"train_{sampler}"
        out.append(Check(f"train 2 steps ({sampler})", _train_argv(size, sampler, run, tokenizer), consistency, limit,
                         metrics=run / "metrics.jsonl"))
    return out


def _env(extra: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """This process's environment for a tool: the repository on PYTHONPATH, unbuffered output, and ``extra``
    ((variable, value) pairs; XLA_FLAGS appended to this process's own)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    for name, value in extra:
        env[name] = " ".join(filter(None, [env.get(name, ""), value])) if name == "XLA_FLAGS" else value
    return env


def run_group(argv: tuple[str, ...], out, timeout: float, env: tuple[tuple[str, str], ...] = ()) -> int | None:
    """Run ``argv`` in the repository in a process group of its own (``env``: variables of its own, as
    ``_env`` adds them), its output (stdout and stderr) to the file ``out``; returns its exit status, or
    None when it ran past ``timeout`` seconds. The whole
    group (the tool and every process it started) is killed once it ends, times out or this process
    is stopped (an exception here: Ctrl-C, or SIGTERM through ``main``'s handler)."""
    child = subprocess.Popen(argv, cwd=REPO, env=_env(env), stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        return child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone: nothing of it left
            pass
        child.wait()


def default_backend(timeout: float = 300) -> str:
    """jax's default backend here ("cpu", "gpu", "tpu"), asked in a process of its own: this one must
    not hold the accelerator the checks need (a TPU is one process's; jax takes most of a GPU's
    memory). Raises ``UsageError`` when jax does not answer."""
    with tempfile.TemporaryFile("w+") as out:
        status = run_group((sys.executable, "-c", "import jax; print(jax.default_backend())"), out, timeout)
        out.seek(0)
        lines = out.read().strip().splitlines()
    if status != 0 or not lines:
        raise UsageError(f"jax did not start here ({'timed out' if status is None else f'status {status}'}: "
                         f"{lines[-1] if lines else 'no output'}): check the JAX install (README.md)")
    return lines[-1].strip()


def run_check(check: Check, log: pathlib.Path) -> dict:
    """Run one check (``run_group``); its output to ``log``. Returns {status, seconds, figures}: status
    "ok", "crashed (status N)", "timed out" or "no figures"; a figure is a number or "n/a" (the tool
    could not measure it)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        code = run_group(check.argv, out, check.timeout, check.env)
    status = "timed out" if code is None else "ok" if code == 0 else f"crashed (status {code})"
    text = log.read_text(errors="replace")
    if check.metrics is not None and check.metrics.exists():  # the figures are the last step's metrics
        lines = check.metrics.read_text().splitlines()
        text += "\n" + (lines[-1] if lines else "")
        log.write_text(text)
    figures = {}
    for name, pattern in check.figures.items():
        found = re.findall(pattern, text)
        if found:
            figures[name] = "n/a" if found[-1] == "n/a" else float(found[-1].removesuffix(" ms"))
    if status == "ok" and not figures:
        status = "no figures"
    last = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    return {"status": status, "seconds": round(time.perf_counter() - start, 1), "figures": figures,
            "last_line": "" if status == "ok" else last[:200], "log": str(log)}


def table(results: dict) -> str:
    lines = [f"{'check':<28}{'status':<22}{'seconds':>8}  figures"]
    for name, r in results.items():
        figures = ", ".join(f"{k} {v if isinstance(v, str) else f'{v:g}'}" for k, v in r["figures"].items())
        figures = figures or r["last_line"] or "-"
        lines.append(f"{name:<28}{r['status']:<22}{r['seconds']:>8.1f}  {figures}")
    return "\n".join(lines)


def _stopped(signum, frame):
    raise SystemExit(128 + signum)  # through run_group's cleanup: the running check's group is killed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("full", "tiny"), default="full",
                        help="full: the sizes an accelerator is judged at (default; refused on a CPU host); tiny: "
                             "any machine, seconds")
    parser.add_argument("--only", default="", help="comma-separated check names' starts (decode, sampling, update, "
                                                   "train, plan); default all")
    parser.add_argument("--logs", default="", help="folder for each check's output (default: a temporary one, "
                                                   "deleted when every check passed)")
    parser.add_argument("--keep_logs", action="store_true", help="keep the temporary logs folder when every check "
                                                                 "passed too")
    parser.add_argument("--out", default="", help="also write the results as JSON to this file (after each check)")
    parser.add_argument("--tokenizer", default="", help="the trainer checks' tokenizer folder (default: the "
                                                        "repository's Qwen one); at --size=tiny its vocabulary "
                                                        "sizes the model's (else Qwen's 151,936 entries)")
    args = parser.parse_args(argv)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    chosen = lambda logs, topology=None: [c for c in plan_checks(args.size, topology, args.tokenizer)  # noqa: E731
                                          + checks(args.size, logs, args.tokenizer)
                                          if not wanted or any(c.name.startswith(w) for w in wanted)]
    if not chosen(pathlib.Path("."), "h200x1"):  # before anything is written
        parser.error(f"--only={args.only}: no check starts with that (decode, sampling, update, train, plan)")
    previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        return run_main("accelerator_check", _run, args, chosen)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, chosen) -> int:
    backend = default_backend()
    topology, why_none = None, "none on a TPU (the check predicts one-GPU hosts)"
    if backend == "gpu":
        topology, kind = local_topology()
        why_none = f"none: pacs_jax/topologies.py has no one-device topology of a {kind}"
    if backend == "cpu":
        why_none = "none on a CPU (tools/plan_step.py compiles for an accelerator's topology)"
        if args.size != "tiny":
            raise UsageError("no accelerator here (jax's default backend is cpu): the full size would run this CPU "
                             "out of memory; --size=tiny checks the same paths at tiny shapes on any machine")
        print("[accelerator_check] no accelerator here (jax's default backend is cpu): the tiny sizes", flush=True)
    else:
        print(f"[accelerator_check] jax's default backend: {backend}; the {args.size} sizes", flush=True)
    temporary = not args.logs
    logs = pathlib.Path(args.logs or tempfile.mkdtemp(prefix="accelerator_check_"))
    logs.mkdir(parents=True, exist_ok=True)
    results = {}
    for check in chosen(logs, topology):
        print(f"[accelerator_check] {check.name} ...", flush=True)
        results[check.name] = run_check(check, logs / (re.sub(r"\W+", "_", check.name).strip("_") + ".log"))
        print(f"[accelerator_check] {check.name}: {results[check.name]['status']} "
              f"({results[check.name]['seconds']:.0f} s)", flush=True)
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    passed = all(r["status"] == "ok" for r in results.values())
    print(table(results))
    print(comparison(results, why_none))
    if temporary and passed and not args.keep_logs:
        shutil.rmtree(logs)
        print("logs: deleted (every check passed; --keep_logs keeps them)")
    else:
        print(f"logs: {logs}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
