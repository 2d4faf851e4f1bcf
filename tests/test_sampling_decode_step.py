"""The sampler's decode step compiled alone (pacs_jax/sampling/decode.py ``decode_step``, through
``engine.lower_decode_step``): from abstract arguments only, for each K/V store, as a cost analysis
of one step compiles it. Its tokens inside the sampler: tests/test_sampling_continuous.py."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from pacs_jax import models, sampling
from pacs_jax.sampling import decode, engine

CFG = models.QwenConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("page_size", [None, 4], ids=["contiguous", "paged"])
@pytest.mark.parametrize("refills", [True, False], ids=["refills", "narrow"])
def test_the_decode_step_lowers_and_compiles_alone_from_abstract_arguments(page_size, refills):
    """An abstract model (no parameter is made) and abstract prompts: the step maps a decode state to
    one of the same shapes (it chains), its steps counter an int32 scalar; it decodes the call's 6
    slots at once (a [6, 96] logits block), and the contiguous store holds the [L, 6, K, 16 + 8, Dh]
    cache rows where the paged one holds none."""
    graphdef, state = models.abstract_model(CFG)
    prompts = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    settings = sampling.SamplingSettings(max_new_tokens=8, n=2, temperature=1.0, top_p=0.9, slots=6,
                                         page_size=page_size)
    lowered = engine.lower_decode_step(graphdef, state, prompts, prompts, settings, refills=refills)
    state_in = lowered.args_info[0][4]  # (layout, queue, store, selection, state)
    out = lowered.out_info
    assert isinstance(out, decode.DecodeState)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), out) == jax.tree.map(lambda a: (a.shape, a.dtype), state_in)
    assert out.steps.shape == () and out.slots.row.shape == (6,)
    compiled = lowered.compile()
    text = compiled.as_text()
    assert re.search(r"f32\[6,96\]", text), "one [slots, vocab] logits block a step"
    contiguous_cache = re.search(r"\[2,6,2,24,16\]", text)  # [L, slots, K, 16 + 8, Dh]
    assert (contiguous_cache is None) == (page_size is not None)


def test_a_mixture_of_experts_decode_step_takes_its_weights_split_as_the_sampler_holds_them():
    """On a (1, 2, 4) mesh the step compiled alone (what tools/plan_step.py costs) takes every expert kernel
    split over "tensor" and replicated over the batch axes, as the sampler's decode layout holds them: abstract
    parameters from ``jax.eval_shape`` carry no sharding, and unplaced the experts came in whole."""
    from pacs_jax.sharding import make_mesh

    cfg = models.QwenConfig(model_type="qwen3_moe", vocab_size=96, hidden_size=48, intermediate_size=80,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, attention_bias=False)
    with jax.set_mesh(make_mesh(1, 2, 4)):
        graphdef, state = models.abstract_model(cfg)
        prompts = jax.ShapeDtypeStruct((8, 16), jnp.int32)
        settings = sampling.SamplingSettings(max_new_tokens=8, n=2, temperature=1.0, slots=8, page_size=4)
        compiled = engine.lower_decode_step(graphdef, state, prompts, prompts, settings).compile()
    layout = compiled.input_shardings[0][0]
    experts = [s.spec for path, s in jax.tree_util.tree_leaves_with_path(layout)
               if any("gate_kernel" in str(k) or "down_kernel" in str(k) for k in path) and len(s.spec) == 3]
    assert experts and all("tensor" in spec and not {"fsdp", "data"} & set(spec) for spec in experts), experts
