"""One run on several processes (issue: multi-host), proven with real processes on this machine.

Two processes x 4 CPU devices (launch/local.sh, gloo collectives) train a shrunk paper config (tiny
random Qwen, a mixture of experts with its experts split over fsdp, the Qwen tokenizer cut to 4,096 entries as
its vocabulary, conftest.py's small_tokenizer_dir, and DeepScaleR prompts) with the continuous sampler exactly as one
process x 8 devices does with the static one, on a
mesh whose device order gives each process rows at two places of the batch axis; a checkpoint
the 2 processes wrote restores in one; a process that never starts is named by the others; and
launch/tpu_pod.sh prints the gcloud sequence of a v5p-64 run with every flag intact.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from flax import nnx

from conftest import REPO
from pacs_jax import checkpoints, distributed
from train_helpers import compile_cache_dir, load_config, train_env

LOCAL = REPO / "launch" / "local.sh"
TPU_POD = REPO / "launch" / "tpu_pod.sh"

# configs/paper.py's Qwen2.5 setup shrunk: 4 prompts x 8 responses of 8 tokens, 2 sampler calls, 2 mini-batches
# of 2 micro-batches. pacs_beta1_noweight and lr 1e-4 so that a random model (reward 0 everywhere) still
# moves visibly: AdamW moves a weight by about lr a step, 100 x the 1e-6 the runs must agree to (the
# gradients' sums run in another order across processes, which Adam's normalisation amplifies for
# weights with a near-zero gradient: at lr 1e-3 a few of 10 million weights differ by 2e-6). Mesh (data 4, tensor 2) in the device order 0 1 4 5 2 3 6 7: with 2 processes of 4
# devices, process 0 holds batch rows 0-7 and 16-23, process 1 rows 8-15 and 24-31.
SHRUNK = [
    "--config=configs/paper.py:qwen25_3b,pacs_beta1_noweight",
    "--config.model.preset=", "--config.model.model_type=qwen2", "--config.model.hidden_size=64",
    "--config.model.intermediate_size=128", "--config.model.num_hidden_layers=2",
    "--config.model.num_attention_heads=4", "--config.model.num_key_value_heads=2", "--config.model.head_dim=16",
    "--config.model.rope_theta=10000.0", "--config.model.tie_word_embeddings=True", "--config.model.vocab_size=0",
    "--config.data.max_prompt_length=256", "--config.data.prompt_buckets=(256,)",
    "--config.train.steps=2", "--config.train.prompts_per_step=4", "--config.train.mini_batches=2",
    "--config.train.micro_batches=2", "--config.train.checkpoint_every=1", "--config.train.logprob_micro_batches=0",
    "--config.rollout.micro_batches=2", "--config.rollout.max_new_tokens=8", "--config.rollout.response_buckets=(8,)",
    "--config.rollout.slots=8", "--config.rollout.tail_slots=0",  # paged: 2 decode slots per batch shard for the 8 responses of its prompt
    "--config.optim.lr=0.0001", "--config.reward.workers=1", "--config.eval.sets=",
    "--config.mesh.data=4", "--config.mesh.fsdp=1", "--config.mesh.tensor=2",
    "--config.mesh.device_order=(0,1,4,5,2,3,6,7)",
]
COMPARED = ("loss", "reward_mean", "sampled_tokens_checksum", "response_length_mean", "grad_norm")
# The runs of ``runs`` train the same model with Qwen3-MoE's sparse blocks instead of its MLPs (4 experts, 2 a token)
# and the experts split over fsdp (model.expert_parallel), on the mesh (data 2, fsdp 2, tensor 2) in the same device
# order: batch shards (0, 0) and (1, 0) on process 0, (0, 1) and (1, 1) on process 1, so each fsdp pair exchanging
# its tokens spans both processes. (LoRA's runs below keep the dense model; tests/test_moe_lora.py splits the experts'
# adapters over 2x2x2 devices in one process.)
MOE = ("--config.model.model_type=qwen3_moe", "--config.model.num_experts=4", "--config.model.num_experts_per_tok=2",
       "--config.model.moe_intermediate_size=64", "--config.model.expert_parallel=True", "--config.mesh.data=2",
       "--config.mesh.fsdp=2")


def _env(cache_dir=None, **extra) -> dict:
    """CPU, no inherited device count, optionally the session's compilation cache; plus ``extra``."""
    return {**train_env(cache_dir), **extra}


def _train(workdir, data_file, *, processes: int, flags: tuple[str, ...] = (), sampler: str = "static") -> None:
    """A run of SHRUNK in ``workdir``: 1 process x 8 devices on ``sampler`` (carry-over's runs pass "paged", the
    one it runs on) or 2 processes x 4 devices, reading and writing the session's compilation cache (whose
    file lock, tests/conftest.py, keeps a process from reading an entry that another is writing: before it,
    an abort seen once in CI). The run on padded rows reads the sampler that the 1-process run compiled, the
    resumed run every program."""
    flags = [*SHRUNK, *flags, f"--config.data.train_files=('{data_file}',)", f"--workdir={workdir}",
             f"--config.data.tokenizer={data_file.parents[1] / 'tokenizer'}"]  # data_file's, written beside it
    command = [sys.executable, "-m", "pacs_jax.train", *flags]
    if processes == 1:  # by default the static sampler (one slot per response) against the 2 processes' paged one
        command.append(f"--config.rollout.sampler={sampler}")
        env = _env(compile_cache_dir())
        env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"  # the suite's other flags kept
        run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    else:
        run = subprocess.run([str(LOCAL), "--processes", str(processes), "--devices_per_process", str(8 // processes),
                              "--", *command], cwd=REPO, env=_env(compile_cache_dir()), capture_output=True, text=True,
                             timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[:5000] + run.stderr[-5000:]


def _metrics(workdir) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}


def _params(workdir, step: int) -> dict[str, np.ndarray]:
    model = checkpoints.from_pretrained(workdir / "checkpoints" / str(step))
    return {"/".join(map(str, path)): np.asarray(v.get_value(), np.float32)
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def data_file(shared_data, small_tokenizer_dir, tmp_path_factory):
    """The 24 shortest problems of the real DeepScaleR subset, in its own file format, and beside its folder
    the small tokenizer that _train's runs read (data_file.parents[1] / "tokenizer")."""
    rows = json.loads((shared_data / "deepscaler_subset" / "math.json").read_text())
    path = tmp_path_factory.mktemp("data") / "deepscaler_subset" / "math.json"  # the folder names the format
    shutil.copytree(small_tokenizer_dir, path.parents[1] / "tokenizer")
    path.parent.mkdir()
    path.write_text(json.dumps(sorted(rows, key=lambda r: len(r["problem"]))[:24]))
    return path


@pytest.fixture(scope="module")
def runs(data_file, tmp_path_factory):
    """(2 processes x 4 devices, 1 process x 8 devices) workdirs of the same 2-step run, and the 1-process
    run on padded rows (train.packing False), its first step (a 2-process one cost a second process's start-up
    and compilations). The 1-process run writes its last step's checkpoint only (the tests read the 2-process
    run's step 1)."""
    two, one = tmp_path_factory.mktemp("two_processes"), tmp_path_factory.mktemp("one_process")
    padded = tmp_path_factory.mktemp("one_process_padded")
    _train(two, data_file, processes=2, flags=MOE)
    _train(one, data_file, processes=1, flags=(*MOE, "--config.train.checkpoint_every=0"))
    _train(padded, data_file, processes=1, flags=(*MOE, "--config.train.packing=False", "--config.train.steps=1"))
    return two, one, padded


@pytest.mark.slow(seconds=190)  # the three runs of the fixture
def test_two_processes_train_exactly_like_one(runs):
    """A mixture-of-experts model with its experts split over fsdp (MOE) on 2 processes x 4 devices: every metric,
    the parameters and the experts' split as 1 process x 8 devices."""
    two, one, _ = runs
    m2, m1 = _metrics(two), _metrics(one)
    assert sorted(m2) == sorted(m1) == [1, 2]
    for step in (1, 2):
        for key in COMPARED:
            assert m2[step][key] == pytest.approx(m1[step][key], rel=1e-5, abs=1e-6), (step, key)
    assert m1[1]["sampled_tokens_checksum"] != m1[2]["sampled_tokens_checksum"]  # the checksum sees the tokens
    # nothing compiles after step 1, though step 1's checkpoint was saved in between (Orbax compiles its own
    # transfer programs at a first save on several devices: not the step's, not counted)
    assert m2[2]["compilations"] == m2[1]["compilations"] and m1[2]["compilations"] == m1[1]["compilations"]
    final2, final1 = _params(two, 2), _params(one, 2)
    _assert_same_params(final2, final1)
    assert "layers/mlp/gate_kernel" in final1 and json.loads((two / "config.json").read_text())["model"][
        "expert_parallel"] is True
    moved = max(float(np.abs(final2[k] - v).max()) for k, v in _params(two, 1).items())
    assert moved > 5e-5  # the second update is visible at the 1e-6 tolerance
    assert (two / "hf_export" / "config.json").is_file()  # process 0 wrote the gathered export


@pytest.mark.slow(seconds=25)
def test_two_processes_train_packed_like_padded(runs):
    """Packed passes across 2 processes (each process plans every pass and places its rows of the plan) give
    the step of padded rows (on one process): the same samples, pi_old's entropy and the first loss to
    bfloat16's round-off, and fewer tokens computed packed. (A random model earns no reward, so the update's
    gradients are round-off, which AdamW's first step turns into full steps: later metrics and the parameters
    are compared packed against padded in tests/test_rl_packing.py, on the 2x2x2 mesh and with mixed
    rewards.)"""
    two, _, padded = runs
    packed_rows, padded_rows = _metrics(two), _metrics(padded)
    for key in ("sampled_tokens_checksum", "response_length_mean", "tokens_real"):
        assert packed_rows[1][key] == padded_rows[1][key], key
    for key in ("entropy", "loss"):
        assert packed_rows[1][key] == pytest.approx(padded_rows[1][key], rel=5e-3), key
    assert packed_rows[1]["tokens_computed"] < padded_rows[1]["tokens_computed"]


@pytest.mark.slow(seconds=25)
def test_a_two_process_checkpoint_restores_in_one_process(runs, data_file, tmp_path):
    """Step 1 of the 2-process run (each process wrote its own shards), resumed by 1 process x 8 devices,
    ends where both straight runs end. (The other way, 2 processes restoring their shards, is
    test_multihost_signals.py's resume after Ctrl-C.)"""
    two, one, _ = runs
    workdir = tmp_path / "resumed"
    shutil.copytree(two, workdir)
    shutil.rmtree(workdir / "checkpoints" / "2")
    shutil.rmtree(workdir / "hf_export")
    _train(workdir, data_file, processes=1, flags=MOE)
    _assert_same_params(_params(workdir, 2), _params(one, 2))
    resumed = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()][-1]
    assert resumed["step"] == 2
    assert resumed["sampled_tokens_checksum"] == _metrics(one)[2]["sampled_tokens_checksum"]


# LoRA (rank 4, every linear layer) with the KL loss, and carry-over rollouts (rollout.carry_over: one sampler
# call a step, 3 steps): one pair of runs, 2 processes x 4 devices and 1 x 8 (both on carry-over's paged
# sampler), for the LoRA and the carry-over tests (each pair cost a 2-process run's start-up and compilations);
# step 3's checkpoint only, the one the tests read (a save of every step cost each process two more)
LORA_CARRY_OVER = ("--config.model.lora_rank=4", "--config.model.lora_alpha=8", "--config.optim.lr=0.001",
                   "--config.algorithm.use_kl_loss=True", "--config.algorithm.kl_loss_coef=0.1",
                   "--config.algorithm.pacs.adv_estimator=naive", "--config.rollout.carry_over=True",
                   "--config.rollout.micro_batches=1", "--config.train.steps=3", "--config.train.checkpoint_every=0")


@pytest.fixture(scope="module")
def lora_carry_over_runs(data_file, tmp_path_factory):
    """(2 processes x 4 devices, 1 process x 8 devices) workdirs of the same 3-step LORA_CARRY_OVER run."""
    two, one = tmp_path_factory.mktemp("lora_two"), tmp_path_factory.mktemp("lora_one")
    _train(two, data_file, processes=2, flags=LORA_CARRY_OVER)
    _train(one, data_file, processes=1, flags=LORA_CARRY_OVER, sampler="paged")
    return two, one


@pytest.mark.slow(seconds=120)  # the fixture's two runs, one of them on 2 processes
def test_two_processes_train_lora_adapters_exactly_like_one(lora_carry_over_runs):
    """LoRA (rank 4, every linear layer) with the KL loss on 2 processes x 4 devices equals 1 x 8: the metrics,
    the KL to the adapters-off reference, and step 3's checkpoint (which holds the adapters alone: the base is
    drawn again from the run's seed when it loads). No warm-start: it would train the base at full rank (decision
    0014), where AdamW's normalised step turns the process counts' round-off on gradients that are round-off
    alone (k's bias, to which softmax is blind) into differences of up to its lr. PACS's naive advantage
    (psi = r) gives the adapters a gradient before any row earns a reward (the centred estimators give none, and
    B would stay 0); A's gradient is then B-sized, so the two runs' round-off can reach A at ~6e-6 after 2 steps
    (AdamW's step is normalised) and the grad norm at 1.3e-5 relative: compared within 1e-5 and 1e-4. (The runs
    carry rollouts over, test_carry_over_runs_its_queues_across_two_processes: the same on 1 process.)"""
    two, one = lora_carry_over_runs
    m2, m1 = _metrics(two), _metrics(one)
    assert sorted(m2) == sorted(m1) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in (*COMPARED, "actor/kl_loss"):
            assert m2[step][key] == pytest.approx(m1[step][key], rel=1e-4, abs=1e-6), (step, key)
    final2, final1 = _params(two, 3), _params(one, 3)
    assert final2.keys() == final1.keys()
    for name in final1:  # A's gradient is B-sized (~lr after one step): AdamW's normalised step magnifies its round-off
        np.testing.assert_allclose(final2[name], final1[name], rtol=0, atol=1e-5, err_msg=name)
    adapters = [name for name in final1 if "_lora/" in name]
    assert len(adapters) == 14 and max(float(np.abs(final1[k]).max()) for k in adapters if k.endswith("/b")) > 1e-3
    assert m1[2]["actor/kl_loss"] > 1e-6  # the policy differs from the reference (the adapters off)


def _free_port() -> int:
    """A coordinator port whose successor (the start-up barrier) is free too, as launch/local.sh picks it."""
    run = subprocess.run([str(LOCAL), "--processes", "1", "--devices_per_process", "1", "--", sys.executable, "-c",
                          "import os; print(os.environ['JAX_COORDINATOR_ADDRESS'])"],
                         env=_env(), capture_output=True, text=True, timeout=60)
    return int(run.stdout.strip().rpartition(":")[2])


@pytest.mark.slow(seconds=5)  # lora_carry_over_runs' 2-process run
def test_carry_over_runs_its_queues_across_two_processes(lora_carry_over_runs):
    """Carry-over (``rollout.carry_over``) on 2 processes x 4 devices: a queue per batch shard (data 4), each
    process placing the new prompts in the queues' shares alike (training/carry_over.py) and passing the
    carried prompts as its own shards; 3 steps, rows carried from each step into the next, none stale
    past max_staleness, and nothing compiled after step 1; 1 process carries the same rows."""
    two, one = lora_carry_over_runs
    metrics, single = _metrics(two), _metrics(one)
    assert sorted(metrics) == [1, 2, 3]
    assert metrics[1]["carried_rows"] == 0 and metrics[2]["carried_rows"] > 0 and metrics[3]["carried_rows"] > 0, metrics
    assert all(metrics[s]["rollout_staleness_max"] <= 1 for s in (1, 2, 3)), metrics
    assert metrics[3]["compilations"] == metrics[2]["compilations"] == metrics[1]["compilations"], metrics
    assert [single[s]["carried_rows"] for s in (1, 2, 3)] == [metrics[s]["carried_rows"] for s in (1, 2, 3)]


def test_a_process_that_never_starts_is_named_by_the_others():
    port = _free_port()
    started = time.monotonic()
    processes = [subprocess.Popen(
        [sys.executable, "-m", "pacs_jax.train", f"--coordinator=localhost:{port}", "--num_processes=3",
         f"--process_id={i}", "--startup_timeout=4"], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for i in (0, 1)]  # process 2 never starts
    outputs = [p.communicate(timeout=120) for p in processes]
    assert time.monotonic() - started < 60
    for p, (out, err) in zip(processes, outputs):
        assert p.returncode != 0
        assert "processes [2] of 3 did not join the start-up barrier within 4 s" in err, err[-2000:]


def test_a_process_without_its_coordinator_says_so():
    port = _free_port()
    with socket.socket() as held:  # bound, never listening: the barrier port refuses, and no other test takes it
        held.bind(("", port + 1))
        run = subprocess.run([sys.executable, "-m", "pacs_jax.train", f"--coordinator=localhost:{port}",
                              "--num_processes=2", "--process_id=1", "--startup_timeout=2"],
                             cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert f"process 0 (the coordinator, barrier at localhost:{port + 1}) did not answer within 2 s" in run.stderr


def test_another_program_on_the_barrier_port_is_named_not_a_traceback():
    with socket.create_server(("localhost", 0)) as other:  # a program that answers a number, not the barrier
        port = other.getsockname()[1]

        def answer_a_number():
            conn, _ = other.accept()
            with conn:
                conn.makefile().readline()
                conn.sendall(b"7\n")

        thread = threading.Thread(target=answer_a_number)
        thread.start()
        with pytest.raises(distributed.StartupError, match=f"localhost:{port} answered 7, not as process 0's"):
            distributed.rendezvous(f"localhost:{port - 1}", num_processes=2, process_id=1, timeout_s=5)
        thread.join()


def test_local_launcher_prefixes_lines_and_stops_everything_when_one_process_fails():
    script = ("import os, sys, time; i = int(os.environ['JAX_PROCESS_ID']); "
              "print('hello from', i, os.environ['JAX_NUM_PROCESSES'], os.environ['XLA_FLAGS'].split()[-1], "
              "flush=True); time.sleep(1); sys.exit(3) if i == 1 else time.sleep(300)")
    started = time.monotonic()
    run = subprocess.run([str(LOCAL), "--processes", "3", "--devices_per_process", "2", "--", sys.executable, "-c",
                          script], env=_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 3
    assert time.monotonic() - started < 60  # process 0 and 2 (sleeping 300 s) were stopped
    for i in range(3):
        assert f"[{i}] hello from {i} 3 --xla_force_host_platform_device_count=2" in run.stdout
    ok = subprocess.run([str(LOCAL), "--processes", "2", "--devices_per_process", "1", "--", sys.executable, "-c",
                         "pass"], env=_env(), capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr


def _dry_run(*args: str) -> list[list[str]]:
    run = subprocess.run(["bash", str(TPU_POD), args[0], "--dry-run", *args[1:]], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=60, cwd=REPO,  # in the order printed
                         env=_env(PACS_PYTHON=sys.executable))  # `run` checks the config with this Python
    assert run.returncode == 0, run.stdout
    return [shlex.split(line) for line in run.stdout.splitlines() if line.startswith("gcloud ")]


def _flag(command: list[str], name: str) -> str:
    values = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"{name}=")]
    assert len(values) == 1, (name, command)
    return values[0]


def test_tpu_pod_run_dry_run_prints_the_whole_gcloud_sequence():
    override = "--config.data.train_files=('/data/deep scaler.json','/data/b, c.json')"
    commands = _dry_run("run", "--name", "pacs-7b", "--zone", "us-east5-a", "--accelerator", "v5p-64",
                        "--config", "configs/paper.py:qwen25_7b,pacs_beta1", "--repo", "https://example.org/pacs_jax.git",
                        "--workdir", "gs://bucket/run 1", "--", override, "--config.optim.lr=1e-6",
                        "--config.model.path=/home/me/Qwen2.5-7B")  # on the workers' disks: left to the trainer
    verbs = [" ".join(c[1:5]) for c in commands]
    assert verbs == ["compute tpus tpu-vm describe", "compute tpus tpu-vm create", "compute tpus tpu-vm ssh",
                     "compute tpus tpu-vm ssh", "compute tpus tpu-vm ssh"]
    describe, create, setup, start, logs = commands
    assert all(c[5] == "pacs-7b" and _flag(c, "--zone") == "us-east5-a" for c in commands)
    assert _flag(create, "--accelerator-type") == "v5p-64" and _flag(create, "--version") == "v2-alpha-tpuv5"
    assert "--spot" not in create
    for c in (setup, start):
        assert "--worker=all" in c
    assert "--worker=0" in logs
    assert "uv venv" in _flag(setup, "--command") and "https://example.org/pacs_jax.git" in _flag(setup, "--command")
    remote = shlex.split(_flag(start, "--command"))
    train = remote[remote.index("launch/supervise.sh"):]
    assert train[train.index("-m") + 1] == "pacs_jax.train" and "--multihost" in train
    assert "--config=configs/paper.py:qwen25_7b,pacs_beta1" in train
    assert "--workdir=gs://bucket/run 1" in train
    assert override in train and "--config.optim.lr=1e-6" in train  # one argument each, spaces and commas intact


@pytest.mark.parametrize("accelerator, runtime", [("v6e-64", "v2-alpha-tpuv6e"), ("v5e-16", "v2-alpha-tpuv5-lite"),
                                                  ("v4-32", "tpu-ubuntu2204-base")])
def test_tpu_pod_picks_the_runtime_of_each_accelerator_and_retries_queued_resources(accelerator, runtime):
    create = [c for c in _dry_run("create", "--name", "n", "--zone", "z", "--accelerator", accelerator,
                                  "--mode", "queued", "--spot") if c[3] == "queued-resources"]
    assert [c[4] for c in create] == ["create", "describe"]
    assert _flag(create[0], "--runtime-version") == runtime and "--spot" in create[0]
    assert _flag(create[0], "--accelerator-type") == accelerator.replace("v5e-", "v5litepod-")


def test_tpu_pod_refuses_bad_arguments():
    for args, message in ((["run", "--zone", "z"], "--name is required"),
                          (["create", "--name", "n", "--zone", "z", "--accelerator", "v9-8"], "--accelerator 'v9-8'"),
                          (["deploy"], "unknown command 'deploy'"),
                          (["run", "--name", "n", "--zone", "z", "--oops"], "unknown option '--oops'")):
        run = subprocess.run(["bash", str(TPU_POD), *args], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)


def test_gpu_node_dry_run_passes_multihost_under_slurm_and_keeps_flags_intact():
    override = "--config.data.train_files=('/data/a b.json','/data/c.json')"
    args = ["bash", str(REPO / "launch" / "gpu_node.sh"), "--dry-run", "--config", "configs/paper.py:qwen25_3b,grpo",
            "--workdir", "/shared/runs/3b", "--", override]
    slurm = subprocess.run(args, capture_output=True, text=True, timeout=60, env=_env(SLURM_NTASKS="4"))
    train = shlex.split(slurm.stdout.splitlines()[-1])
    assert slurm.returncode == 0 and train[:4] == ["bash", "launch/supervise.sh", "--", ".venv/bin/python"]
    assert "--multihost" in train and override in train and "--workdir=/shared/runs/3b" in train
    manual = subprocess.run(args[:3] + ["--no-supervise", "--coordinator", "node0:8476", "--num_processes", "2",
                                        "--process_id", "1"] + args[3:], capture_output=True, text=True, timeout=60,
                            env=_env(SLURM_NTASKS="1"))
    train = shlex.split(manual.stdout.splitlines()[-1])
    assert train[0] == ".venv/bin/python" and "--multihost" not in train
    assert {"--coordinator=node0:8476", "--num_processes=2", "--process_id=1", override} <= set(train)


@pytest.mark.parametrize("arch", ["qwen2_untied_bias", "qwen3_tied_head_dim24"])
def test_each_device_block_of_an_hf_tensor_is_read_alone_and_matches_transformers(arch, tmp_path, monkeypatch):
    """Loading onto a (2, 1, 4) mesh reads blocks, never a whole tensor that the tensor axis splits, and the
    sharded model's parameters equal the HF weights (the whole-tensor read on one device)."""
    import jax

    from pacs_jax.models import hf_weights
    from pacs_jax.sharding import make_mesh
    from qwen_reference import save_random_hf_model

    save_random_hf_model(arch, tmp_path, seed=3)
    reads: list[tuple[str, tuple | None]] = []
    original = hf_weights.HFWeightReader.read

    def recording(self, hf_name, index=None):
        reads.append((hf_name, index))
        return original(self, hf_name, index)

    monkeypatch.setattr(hf_weights.HFWeightReader, "read", recording)
    with jax.set_mesh(make_mesh(2, 1, 4)):
        sharded = checkpoints.from_pretrained(tmp_path)
    blocks = [(name, index) for name, index in reads if name == "model.layers.1.self_attn.q_proj.weight"]
    full_rows = 8 * sharded.cfg.head_dim  # 8 query heads
    assert len(blocks) == 4 and sorted((i[0].start, i[0].stop) for _, i in blocks) == [
        (k * full_rows // 4, (k + 1) * full_rows // 4) for k in range(4)]  # one head block per tensor shard
    reads.clear()
    whole = checkpoints.from_pretrained(tmp_path)  # no mesh set: one device
    assert all(index is None for _, index in reads)
    ours = dict(nnx.to_flat_state(nnx.state(sharded, nnx.Param)))
    for path, var in nnx.to_flat_state(nnx.state(whole, nnx.Param)):
        np.testing.assert_array_equal(np.asarray(ours[path].get_value()), np.asarray(var.get_value()), err_msg=str(path))


def test_a_mesh_the_slice_cannot_build_is_an_error_naming_the_fields(monkeypatch):
    """jax.make_mesh refuses shapes that do not follow the physical topology (a v6e-64 as (2, 8, 4)
    raises NotImplementedError deep inside); building the config's mesh reports the mesh fields
    instead (the CLI prints it as a usage error), and the config check refuses a bad device order."""
    import jax

    from pacs_jax.sharding import config_mesh
    from pacs_jax.training.config_check import ConfigError, validate_config

    def refuse(*args, **kwargs):
        raise NotImplementedError("Unsupported physical mesh shape")

    monkeypatch.setattr(jax, "make_mesh", refuse)
    config = load_config("default.py")
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
    with pytest.raises(ValueError, match=r"mesh\.data / mesh\.fsdp / mesh\.tensor = \(2, 2, 2\): no mesh of that "
                                         r"shape fits the 8 devices .*NotImplementedError"):
        config_mesh(config.mesh)
    config.mesh.device_order = (0, 1, 2, 3, 4, 5, 6, 6)
    with pytest.raises(ConfigError, match=r"mesh\.device_order=\(0, 1, 2, 3, 4, 5, 6, 6\): must list each"):
        validate_config(config)
    config.mesh.device_order = (0, 1, 4, 5, 2, 3, 6, 7)  # an explicit order needs no jax.make_mesh
    assert [d.id for d in config_mesh(config.mesh).devices.reshape(-1)] == [0, 1, 4, 5, 2, 3, 6, 7]


def test_launch_scripts_are_shellcheck_clean():
    scripts = sorted(str(p.relative_to(REPO)) for p in (REPO / "launch").glob("*.sh"))
    assert len(scripts) == 5
    lint = subprocess.run([str(pathlib.Path(sys.executable).parent / "shellcheck"), "-x", *scripts], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout
