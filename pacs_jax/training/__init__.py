"""The parts of the trainer (pacs_jax/train.py): optimizer, rollout-to-batch, update step,
train-state checkpoints, metrics, config validation."""
