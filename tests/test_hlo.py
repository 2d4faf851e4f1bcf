"""pacs_jax/hlo.py's loop profile on a compiled CPU program whose loops are known: one counted loop, one
whose trip count is an argument (only the device knows it) with a branch inside; the profile of the
latter alone. Its program profile (launches times known trips) on the same program, and its count of
a layer's weights copied out of their stack on the HLO XLA:GPU writes for a scanned layer (a slice
fusion ending in a copy, in a loop of 28 trips) and an unrolled one (a slice fusion; a gemm reading
the stack in place)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pacs_jax import hlo


def _program(x, n):
    counted = jax.lax.fori_loop(0, 7, lambda i, c: jnp.sin(c) @ c, x)
    branching = jax.lax.fori_loop(0, n, lambda i, c: jax.lax.cond(c[0, 0] > 0, jnp.cos, jnp.sin, c) @ c, x)
    return counted + branching


def test_loop_profile_counts_loops_by_whether_their_trips_are_known_and_the_branches_inside():
    text = jax.jit(_program).lower(jnp.ones((8, 8)), 3).compile().as_text()
    whole, device_trips = hlo.loop_profile(text), hlo.loop_profile(text, device_trip_loops_only=True)
    assert (whole.loops, whole.unknown_trip_loops, whole.conditionals) == (2, 1, 1)
    assert (device_trips.loops, device_trips.unknown_trip_loops, device_trips.conditionals) == (1, 1, 1)
    assert device_trips.fusions + sum(device_trips.custom_calls.values()) < whole.fusions + sum(whole.custom_calls.values())
    assert "1 loops (1 with a trip count only the device knows); 1 conditionals" in device_trips.describe()


def test_program_profile_counts_launches_times_the_known_trips():
    text = jax.jit(_program).lower(jnp.ones((8, 8)), 3).compile().as_text()
    once, launched = hlo.loop_profile(text), hlo.program_profile(text)
    assert (launched.loops, launched.unknown_trip_loops) == (2, 1)
    assert launched.fusions + sum(launched.custom_calls.values()) > once.fusions + sum(once.custom_calls.values())


# The shape of XLA:GPU's HLO for a decode step's layers (tools/plan_step.py --topology=h200x1), cut down.
_SCANNED = """HloModule step

%fused_dynamic_slice.7 (param_0: bf16[28,1536,8960], param_1: s32[]) -> bf16[1,1536,8960] {
  %param_0 = bf16[28,1536,8960]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %dynamic_slice.22 = bf16[1,1536,8960]{2,1,0} dynamic-slice(%param_0, %param_1, %c, %c), dynamic_slice_sizes={1,1536,8960}
  ROOT %copy.96 = bf16[1,1536,8960]{2,1,0} copy(%dynamic_slice.22)
}

%body (arg: (s32[], bf16[28,1536,8960])) -> (s32[], bf16[28,1536,8960]) {
  %arg = (s32[], bf16[28,1536,8960]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %w = bf16[28,1536,8960]{2,1,0} get-tuple-element(%arg), index=1
  %loop_dynamic_slice_fusion.7 = bf16[1,1536,8960]{2,1,0} fusion(%w, %i), kind=kCustom, calls=%fused_dynamic_slice.7
  ROOT %t = (s32[], bf16[28,1536,8960]{2,1,0}) tuple(%i, %w)
}

%cond (arg: (s32[], bf16[28,1536,8960])) -> pred[] {
  %arg = (s32[], bf16[28,1536,8960]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %n = s32[] constant(28)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (w: bf16[28,1536,8960]) -> (s32[], bf16[28,1536,8960]) {
  %w = bf16[28,1536,8960]{2,1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[28,1536,8960]{2,1,0}) tuple(%zero, %w)
  ROOT %while = (s32[], bf16[28,1536,8960]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"28"}}
}
"""

_UNROLLED = """HloModule step

%wrapped_slice_computation (param_0: bf16[28,12,128,1536]) -> bf16[1,12,128,1536] {
  %param_0 = bf16[28,12,128,1536]{3,2,1,0} parameter(0)
  ROOT %slice = bf16[1,12,128,1536]{3,2,1,0} slice(%param_0), slice={[3:4], [0:12], [0:128], [0:1536]}
}

%gemm_computation (p0: bf16[256,1536], p1: bf16[28,1536,8960]) -> f32[256,8960] {
  %p0 = bf16[256,1536]{1,0} parameter(0)
  %p1 = bf16[28,1536,8960]{2,1,0} parameter(1)
  %s = bf16[1,1536,8960]{2,1,0} slice(%p1), slice={[3:4], [0:1536], [0:8960]}
  %b = bf16[1536,8960]{1,0} bitcast(%s)
  ROOT %dot = f32[256,8960]{1,0} dot(%p0, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: bf16[256,1536], o: bf16[28,12,128,1536], w: bf16[28,1536,8960]) -> f32[256,8960] {
  %x = bf16[256,1536]{1,0} parameter(0)
  %o = bf16[28,12,128,1536]{3,2,1,0} parameter(1)
  %w = bf16[28,1536,8960]{2,1,0} parameter(2)
  %wrapped_slice = bf16[1,12,128,1536]{3,2,1,0} fusion(%o), kind=kLoop, calls=%wrapped_slice_computation
  ROOT %gemm_fusion_dot = f32[256,8960]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
}
"""


def test_weight_copies_counts_a_layers_slice_written_to_its_own_buffer_times_the_trips():
    weights = {name: jax.ShapeDtypeStruct(shape, jnp.bfloat16) for name, shape in (
        ("gate_kernel", (28, 1536, 8960)), ("up_kernel", (28, 1536, 8960)), ("o_kernel", (28, 12, 128, 1536)))}
    assert hlo.weight_copies(_SCANNED, weights) == {"gate_kernel/up_kernel": 28}
    assert hlo.weight_copies(_SCANNED, weights, device_trip_loops_only=True) == {}  # its loop's trips are known
    assert hlo.weight_copies(_UNROLLED, weights) == {"o_kernel": 1}  # the gemm reads gate / up in place
    assert hlo.program_profile(_UNROLLED).custom_calls == {"__triton_nested_gemm_fusion": 1}
