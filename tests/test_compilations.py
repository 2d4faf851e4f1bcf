"""training/compilations.py: a program read from JAX's persistent compilation cache counts as built, as one
that XLA compiled does (the suite's processes share that cache, and a user may set one: a recompilation after
step 1 must show in the `compilations` metric either way)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pacs_jax.training import compilations


def test_a_program_compiled_then_read_from_the_persistent_cache_is_built_both_times():
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs  # conftest.py's
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # this tiny program is written too
    try:
        compilations.start_counting()
        offset = np.random.default_rng().integers(1 << 30)  # a program no earlier run of the suite cached

        @jax.jit
        def shifted(x):
            return jnp.sin(x) + offset

        x = jnp.arange(7.0)
        before = compilations.compilations()
        with compilations.built() as first:
            jax.block_until_ready(shifted(x))
        with compilations.built() as again:
            jax.block_until_ready(shifted(x))  # in memory: nothing built
        jax.clear_caches()
        with compilations.built() as cached:
            jax.block_until_ready(shifted(x))
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
    assert first == ["/jax/core/compile/backend_compile_duration"], first
    assert again == []
    # read from the cache (cleared caches may also compile a small program of JAX's own beside it)
    assert cached.count("/jax/compilation_cache/cache_hits") == 1, cached
    assert compilations.compilations() - before == len(first) + len(cached)  # the metric counts both kinds
