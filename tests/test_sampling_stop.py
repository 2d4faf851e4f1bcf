"""Issue 67 item 6: Ctrl-C in sampling is seen at the next chunk of decode steps, whatever the device's timing.

A sampler call is a program per chunk of ``chunk_steps`` decode steps (sampling/engine.py ``run_chunks``); the
trainer's ``StepWatch`` (training/progress.py) may stop the step between two. It used to ask only while it
polled a chunk's unfinished result: where dispatching the next chunk returns only once the one before has
run (a device that runs a while loop's condition on the host), every result is in at the first look, so
nothing asked and a Ctrl-C waited for the rest of the step's sampling (minutes on a 3000-token call).

Here a stand-in for such a device: each chunk program blocks until it has run. A real SIGINT (the
trainer's handler, ``StopSignals``) lands while chunk ``SIGNAL_AT`` runs, in a call that would run many
more; the step must stop with no chunk dispatched after that one, the bound the design gives (a stop
between two chunks), not after the call's remaining chunks.
"""

from __future__ import annotations

import signal

import jax
import numpy as np
import pytest
from flax import nnx

from pacs_jax import models
from pacs_jax.sampling import engine
from pacs_jax.training.progress import StepInterrupted, StepWatch
from pacs_jax.training.records import PromptBatch
from pacs_jax.training.rollout import RolloutCollector
from pacs_jax.training.signals import StopSignals
from pacs_jax.training.spec import RunSpec
from pacs_jax.training.step_programs import StepPrograms
from train_helpers import load_config

CFG = models.QwenConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16)
PROMPTS, N, MAX_NEW_TOKENS, SLOTS = 2, 4, 64, 4  # 8 rows in 4 slots: two waves of 64 decode steps
SIGNAL_AT = 2  # the chunk during which the SIGINT lands


@pytest.fixture(scope="module")
def collector():
    """The demo's sampler programs on a tiny model, no stop id (every row runs its 64 tokens), and the
    collector of a step's rollout; (collector, params)."""
    config = load_config("default.py")
    config.train.prompts_per_step, config.rollout.n = PROMPTS, N
    config.rollout.max_new_tokens, config.rollout.response_buckets = MAX_NEW_TOKENS, (MAX_NEW_TOKENS,)
    config.rollout.slots, config.rollout.micro_batches, config.train.mini_batches = SLOTS, 1, 1
    spec = RunSpec.unplaced(config)
    graphdef, params = nnx.split(models.init_random(CFG, seed=0))
    programs = StepPrograms(spec, graphdef, params, ())
    return RolloutCollector.from_spec(spec, programs, decode=lambda ids: "", reward_pool=None), params


def _prompts() -> PromptBatch:
    rng = np.random.default_rng(0)
    return PromptBatch([rng.integers(1, CFG.vocab_size, size=9).tolist() for _ in range(PROMPTS)], ["1"] * PROMPTS,
                       ["test"] * PROMPTS)


def test_a_sigint_stops_sampling_at_the_next_chunk_when_each_chunk_runs_before_its_dispatch_returns(
        collector, monkeypatch):
    collector, params = collector
    chunk_program, dispatched = engine._chunk_program, []

    def synchronous(*args, **kwargs):  # a dispatch that returns once its chunk has run
        out = jax.block_until_ready(chunk_program(*args, **kwargs))
        dispatched.append(1)
        if len(dispatched) == SIGNAL_AT and signals is not None:
            signal.raise_signal(signal.SIGINT)  # as Ctrl-C, while the chunk ran
        return out

    monkeypatch.setattr(engine, "_chunk_program", synchronous)
    signals = None
    whole = collector.sample(params, _prompts(), jax.random.key(1), StepWatch.silent())  # the call, unstopped
    chunks = len(dispatched)
    assert int(whole.lengths.sum()) == PROMPTS * N * MAX_NEW_TOKENS and chunks >= SIGNAL_AT + 4, chunks

    dispatched.clear()
    lines = []
    with StopSignals() as signals, signals.deferred():
        watch = StepWatch(lines.append, 30.0, stop_requested=signals.safe_point)
        watch.start_step(1)
        watch.start("sampling")
        with pytest.raises(StepInterrupted) as interrupted:
            collector.sample(params, _prompts(), jax.random.key(1), watch)
    assert signals.requested == "SIGINT"
    assert (interrupted.value.step, interrupted.value.phase) == (1, "sampling")
    # the stop comes between two chunks: none dispatched after the one the signal landed in, of a call of `chunks`
    assert len(dispatched) == SIGNAL_AT, (len(dispatched), chunks)
