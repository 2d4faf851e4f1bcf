"""KV-cache sampling over the mesh: one prefill per prompt, n samples each, one jitted decode loop.

    out = sampling.generate(model, prompts, max_new_tokens=256, n=8, temperature=1.0)
    out.tokens[i * n + j]          # sample j of prompt i (stop id included), with out.logprobs, out.finish_reason

    # the trainer, on padded arrays (see buckets.py for the bucketing):
    graphdef, state = nnx.split(model)
    arrays = sampling.sample(graphdef, state, prompt_tokens, prompt_mask, SamplingSettings(...), key)
"""

from pacs_jax.sampling.buckets import bucket_batch, bucket_length, left_pad
from pacs_jax.sampling.engine import SampleArrays, compile_count, sample, slot_utilisation
from pacs_jax.sampling.generation import GenerateOutput, generate
from pacs_jax.sampling.seam import PAD_ID
from pacs_jax.sampling.settings import SamplingSettings
from pacs_jax.sampling.selection import first_argmax, restrict_to_top, select_tokens

__all__ = ["generate", "GenerateOutput", "SamplingSettings", "sample", "SampleArrays", "compile_count", "slot_utilisation",
           "PAD_ID", "bucket_batch", "bucket_length", "left_pad", "first_argmax", "restrict_to_top",
           "select_tokens"]
