"""The GPU path compiles: the programs of a step for an H200 (compile-only, XLA's CUDA compiler on this
CPU, tests/gpu_compiler.py), so a Triton or Mosaic lowering error fails here rather than at a user's
first step on a GPU (issue 40: the library paged kernel failed to lower for most budgets).

1. The paged decode kernel over the page-table widths the configs and a grid of budgets reach
   (tests/gpu/paged_widths.py), and the old block rule with the library kernel at a width where it
   failed, reproducing that error.
2. The packed-rows kernel (tests/gpu/packed_shapes.py) forward and backward at several shapes.
3. One decode step of the issue 52 H200 run's shape (tools/plan_step.py --topology=h200x1): none of
   its layers' weights copied to a buffer of its own, and its bytes against what it must read; what
   pacs_jax/hlo_cost.py counts of a split-K gemm's partials summed and sliced inside a fusion; the
   fused LM head and token selection (tests/gpu/fused_selection.py) at the models' shapes.
4. tools/plan_memory.py --topology=h200x8 on the paper's Qwen2.5 config shrunk to two narrow layers
   (the real vocabulary and head size), with a budget whose table width has no power-of-2 divisor
   <= 8: sampler, pi_old and update compile, choose the GPU kernels, and the sampler's loops are
   described (kernels, copies, loops whose trips sync with the host): its decode loops copy none of
   the layers' weights.
5. A small bfloat16 model's gradient (tests/gpu/layer_dots.py): what its remat saves of the layers'
   gemms is bfloat16, and on two H200s splitting the batch its weight gradients are summed in float32.
6. tools/plan_step.py's prefill phase of a mixture of experts on h200x8 (tokamax's grouped kernel traced with
   the mesh's GPU as the default device).
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from gpu_compiler import REPO, gpu_python

from configs import default, eval as eval_config, paper


def _config_grid() -> dict:
    """Prompt buckets, sampler budgets and page sizes of every shipped config (rollout and evaluation,
    each evaluation set's own budget), and a grid of budgets besides."""
    configs = [default.get_config(), eval_config.get_config()] + [paper.get_config(f"{m},pacs_beta1")
                                                                    for m in paper.MODELS]
    buckets, budgets, pages = set(), {1, 2, 3, 12, 100, 1000, 1023, 1024, 2047, 2048, 3000, 3072, 4095, 4096}, set()
    for c in configs:
        buckets |= set(c.data.prompt_buckets)
        budgets |= {c.rollout.max_new_tokens, c.eval.max_new_tokens}
        budgets |= {s.get("max_new_tokens") for s in c.eval.final.per_set.values()} - {None}
        pages |= {c.rollout.page_size, c.eval.page_size}
    return {"prompt_buckets": sorted(buckets | {128, 1024}), "budgets": sorted(budgets),
            "page_sizes": sorted(pages | {8, 32}), "also": [[132, 16], [220, 16]], "library_width": 132}


def _run(argv: list[str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([str(gpu_python()), *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow(seconds=60)
def test_paged_kernel_compiles_for_an_h200_at_every_table_width_the_configs_and_budgets_reach():
    """Issue 40's crash: the library kernel with the largest divisor <= 8 of the table width as its
    block (132 pages: 6) fails Triton's power-of-2 lowering; our kernel compiles at every width (one
    of each class of block and padding, and 132 and 220 themselves)."""
    grid = _config_grid()
    result = _run(["tests/gpu/paged_widths.py", json.dumps(grid)], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "size is a power of 2. Encountered an array of shape (6,)" in report["library"], report["library"]
    assert report["failed"] == [] and report["bad"] == [], report
    assert report["widths"] >= 100 and len(report["compiled"]) >= report["classes"], report
    assert [132, 16] in report["compiled"] and [220, 16] in report["compiled"]
    # the kernel reads each K/V head's query rows in place (a masked 16-row tile): G = 8, 7, 4 and 1 compile too
    assert [["heads", h, k] for h, k in ((16, 2), (28, 4), (32, 8), (4, 4))] == [c for c in report["compiled"]
                                                                                 if c[0] == "heads"], report


SHRUNK = ["--config.model.preset=", "--config.model.random_init=True", "--config.model.hidden_size=256",
          "--config.model.intermediate_size=512", "--config.model.num_hidden_layers=2", "--config.model.head_dim=128",
          "--config.model.vocab_size=151936", "--config.model.rope_theta=1000000.0", "--config.model.model_type=qwen2",
          "--config.model.num_attention_heads=4", "--config.model.num_key_value_heads=2"]


@pytest.mark.slow(seconds=95)
def test_a_paper_step_compiles_for_an_h200_with_the_gpu_kernels():
    """The paper's Qwen2.5 step (packed passes, paged sampler, bfloat16, its remat) on an 8-GPU H200
    node, 3000 new tokens: a 220-page table (512 + 2999 tokens in pages of 16), whose largest divisor
    <= 8 is 5, the library kernel's lowering error; 256 slots narrowing to 192, two decode widths (each
    width's decode loop compiles its own kernels: 128 made a third for nothing more to check). With a
    rollout correction (seq_mis: weights and a rejection mask in the update batch, and the correction's
    own program). Every program compiles; the kernels are chosen by models/kernels.py (cuDNN padded,
    our block-sparse Pallas kernel packed, our paged kernel and fused token selection in the decode
    step) and printed."""
    result = _run(["tools/plan_memory.py", "--config=configs/paper.py:qwen25_3b,pacs_beta1", "--topology=h200x8",
                   "--programs=sampler,pi_old,update,rollout_correction", *SHRUNK,
                   "--config.algorithm.rollout_correction.preset=seq_mis", "--config.rollout.max_new_tokens=3000",
                   "--config.rollout.response_buckets=(3000,)", "--config.train.prompts_per_step=64",
                   "--config.train.micro_batches=8", "--config.train.logprob_micro_batches=8",
                   "--config.rollout.slots=256", "--config.rollout.tail_slots=192"], timeout=900)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "[plan_memory] h200x8: 8 compile-only NVIDIA H200 141GB HBM3e devices" in out
    for program in ("sampler", "pi_old", "update", "rollout_correction"):  # the update takes the correction's weights
        assert re.search(rf"^{program} +[\d.]+ ", out, re.M), out
    assert "kernels: attention: cudnn; paged decode: gpu; token selection: gpu; packed attention: packed_gpu" in out, out
    assert "sampler: no copy of the page pool inside its loops" in out
    profile = re.search(r"sampler: its decode loops: (\d+) fusions, library kernels: (.*); (\d+) copies; (\d+) loops "
                        r"\((\d+) with a trip count only the device knows\); (\d+) conditionals", out)
    assert profile, out
    assert "__gpu$xla.gpu.triton" in profile.group(2)  # our paged kernel: a Pallas Triton call in the decode loop
    assert int(profile.group(5)) >= 2  # the decode loops themselves (one a width): one host round trip a step
    assert "sampler: copies of a layer's weights inside its decode loops (a trip of each): none" in out, out
    assert re.search(r"peak per device: [\d.]+ GiB of 141\.00 GiB \(fits\)", out)


def test_packed_attention_kernel_compiles_for_an_h200_at_several_shapes():
    """Packed rows' attention on GPU (our block-sparse Pallas kernel, its backward too) for lengths that
    are no multiple of its blocks, head sizes 64, 96 (padded to 128) and 128, GQA groups 1..7, bf16 and
    f32: each compiles with its three Triton kernels (forward, dq, dk/dv), none falling back to the XLA
    path."""
    result = _run(["tests/gpu/packed_shapes.py"], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["failed"] == [] and len(report["compiled"]) == 4, report
    names = ["pacs_packed_attention_dkv", "pacs_packed_attention_dq", "pacs_packed_attention_fwd"]
    assert all(shape[-2:] == [3, names] for shape in report["compiled"]), report


# The H200 trainer run of issue 52: the paper's Qwen2.5 setup with the 1.5B preset, 32 prompts x 8 x 1,024
# tokens, 256 slots narrowing to 32, one GPU
H200_RUN = ["--config=configs/paper.py:qwen25_3b,pacs_beta1", "--topology=h200x1", "--lengths=budget",
            "--config.model.preset=Qwen2.5-1.5B", "--config.train.prompts_per_step=32",
            "--config.rollout.max_new_tokens=1024", "--config.rollout.response_buckets=(1024,)",
            "--config.rollout.slots=256", "--config.rollout.tail_slots=32", "--config.mesh.data=1",
            "--config.mesh.fsdp=1", "--config.mesh.tensor=1", "--config.train.mini_batches=1",
            "--config.train.micro_batches=1", "--config.train.logprob_micro_batches=1"]


@pytest.mark.slow(seconds=60)
def test_a_decode_step_copies_none_of_its_weights_for_an_h200():
    """The decode step of the issue 52 run, compiled for an H200: plan_step counts what it launches and
    the layers' weights XLA:GPU copies to buffers of their own before the gemms. A layer scan over the
    stacked [L, ...] weights copied seven slices a layer, 196 a step (21.13 GB compiled where 11.19
    must be read, 0.530); the decode layout holds each layer's weights in buffers of their own
    (sampling/engine.py) and the step reads them in place: none copied, 15.88 GB (0.705). Then the
    gate/up gemm writes bfloat16 (models/qwen.py ``_dot_rounded``, not its float32 [256, 17920]) and
    the greedy selection shares the log-normaliser's max (three passes over the logits, not four):
    15.21 GB (0.736). Then hlo_cost counts what the q padding and the K/V scatters read of the q/k/v
    gemm's split-K partials (their own columns, not the whole partials: the test below): 14.74 GB
    (0.759). Then our paged kernel reads its heads' q rows and writes their output rows itself (no
    padded q, no slice or idle-row select of a padded output): 14.59 GB (0.767). Then the LM head and
    token selection run in our fused kernel (no float32 [256, 151936] logits written and read three
    times) and the residual after attention is written once (its o gemm's partials were summed in
    both readers): 13.84 GB (0.809). A copy or a byte that comes back (e.g. the stacked layout, the
    logits) fails here."""
    result = _run(["tools/plan_step.py", "--phases=decode", *H200_RUN], timeout=600)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "copies of a layer's weights a step: none\n" in out, out
    launches = re.search(r"the step launches \d+ fusions, library kernels: (.*); (\d+) copies;", out)
    assert launches and "29 __gpu$xla.gpu.triton" in launches.group(1), out  # our paged kernel a layer, the fused head
    assert "__custom_fusion" not in launches.group(1), out  # XLA:GPU's dynamic-slice copies of the stack
    assert "decode at a full pool: must read 11.19 GB, compiled 13.84 GB (ratio 0.809)" in out, out


def test_the_fused_lm_head_and_token_selection_compiles_for_an_h200_at_the_models_shapes():
    """sampling/fused_selection_gpu.py at Qwen2.5-1.5B's tied head (256 rows and the 32-row tail),
    Qwen2.5-7B's untied [D, V] head and a small float32 case: each compiles to its Triton kernel."""
    result = _run(["tests/gpu/fused_selection.py"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["failed"] == [] and len(report["compiled"]) == 4, report
    assert all(shape[-1] == ["pacs_fused_selection_v128"] for shape in report["compiled"]), report


def test_a_fusion_that_sums_split_k_partials_and_slices_them_counts_the_columns_it_reads():
    """XLA:GPU fuses the sum of a split-K gemm's partials [S, M, N] into each consumer of a slice of it
    (the decode step's q rotary reads q's columns of the q/k/v gemm's partials, each K/V scatter its
    own): a fusion's elements read only the partials of their own columns. hlo_cost counted each
    consumer as reading all of them (here 17.76 MB for 8.32); it now counts the sliced columns."""
    result = _run(["tests/gpu/reduce_slices.py"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    S, M, N, Q, K = 4, 256, 2048, 1536, 256  # tests/gpu/reduce_slices.py
    assert report["fusions"] == [f"bf16[{M},{Q + 128}]{{1,0}}", f"bf16[{M},{K}]{{1,0}}"], report  # both fuse the sum
    reads = 4 * S * M * (Q + K) + 2 * K  # the partials' q and k columns, float32; the bias
    writes = 2 * M * (Q + 128) + 2 * M * K
    assert report["bytes"] == reads + writes, report


def test_the_remat_saves_the_layers_gemm_outputs_in_bfloat16_for_an_h200():
    """The update's remat (dots_with_no_batch_dims_saveable) keeps each layer's gemm outputs for the
    backward pass, stacked over the layer scan. A gemm that returned float32 and was rounded afterwards
    had them saved in float32 (gate/up at the MLP's width, q/o, k/v: twice the bytes and memory; the
    issue 52 update on h200x1 at one micro-batch 7227 -> 5042 GB a pass, 268 -> 156 GiB); each now
    returns the compute dtype (models/qwen.py ``_dot_rounded``)."""
    result = _run(["tests/gpu/layer_dots.py"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"mlp": ["bf16"], "q/o": ["bf16"], "k/v": ["bf16"], "grad_sums": ["f32"]}, report


# A Qwen3-MoE step of the paper's 8B setup shrunk to one sparse layer of 16 experts (4 a token), bfloat16: its
# experts' grouped matmul is tokamax's Mosaic GPU kernel on an H200 (models/moe_gemm_gpu.py)
H200_MOE = ("--config=configs/paper.py:qwen3_8b,pacs_beta1", "--topology=h200x8", "--config.model.preset=",
            "--config.model.random_init=True", "--config.model.hidden_size=256", "--config.model.intermediate_size=512",
            "--config.model.num_hidden_layers=1", "--config.model.head_dim=128", "--config.model.vocab_size=151936",
            "--config.model.rope_theta=1000000.0", "--config.model.model_type=qwen3_moe", "--config.model.num_experts=16",
            "--config.model.num_experts_per_tok=4", "--config.model.moe_intermediate_size=128",
            "--config.model.num_attention_heads=4", "--config.model.num_key_value_heads=2",
            "--config.rollout.max_new_tokens=1024", "--config.rollout.response_buckets=(1024,)",
            "--config.train.prompts_per_step=64", "--config.train.micro_batches=8", "--config.train.logprob_micro_batches=8",
            "--config.rollout.slots=256", "--config.mesh.tensor=2",
            "--config.mesh.fsdp=4")


@pytest.mark.slow(seconds=40)
def test_plan_step_costs_a_moe_prefill_for_an_h200_with_tokamaxs_kernel():
    """tools/plan_step.py's prefill phase of a mixture of experts, compiled for an H200 from this CPU: tokamax reads
    the GPU's generation from JAX's default device while tracing, so the phase is lowered with the mesh's first
    device as the default (``sharding.tracing_device``), as the trainer's programs are. Without it tokamax raised
    "Unsupported GPU architecture" (the 30B's h200x8 plan, issue 66)."""
    result = _run(["tools/plan_step.py", "--phases=prefill", *H200_MOE], timeout=600)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert re.search(r"^prefill +[\d.]+ +[\d.]+ ", out, re.MULTILINE), out
