"""The optimizer of docs/design.md section 6.4: AdamW on fp32 master weights, schedule configurable."""

from __future__ import annotations

import optax

from pacs_jax.training.spec import SCHEDULES


def learning_rate_schedule(lr: float, schedule: str, total_steps: int, warmup_steps: int = 0) -> optax.Schedule:
    """Learning rate per optimizer step: linear warmup from 0, then constant / cosine / linear decay to 0."""
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule={schedule!r}: expected one of {SCHEDULES}")
    decay_steps = max(total_steps - warmup_steps, 1)
    main = {"constant": optax.constant_schedule(lr),
            "cosine": optax.cosine_decay_schedule(lr, decay_steps),
            "linear": optax.linear_schedule(lr, 0.0, decay_steps)}[schedule]
    if warmup_steps <= 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup_steps), main], [warmup_steps])


def make_optimizer(lr: float, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.01,
                   schedule: str = "constant", total_steps: int = 1, warmup_steps: int = 0,
                   grad_clip: float = 0.0) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(AdamW with optional global-norm clipping, its learning-rate schedule). grad_clip 0 = none (PACS)."""
    schedule_fn = learning_rate_schedule(lr, schedule, total_steps, warmup_steps)
    adamw = optax.adamw(schedule_fn, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(grad_clip), adamw), schedule_fn
    return adamw, schedule_fn
