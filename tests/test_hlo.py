"""pacs_jax/hlo.py's loop profile on a compiled CPU program whose loops are known: one counted loop, one
whose trip count is an argument (only the device knows it) with a branch inside; the profile of the
latter alone."""

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
