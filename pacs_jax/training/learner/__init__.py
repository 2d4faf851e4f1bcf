"""The learner's role in a training step: its programs (pi_old, the rollout checks and correction, the
update, PPO's critic, the warm-start), the optimizer, the train state, and the update batch made from the
engine's collected rows. It never imports the engine (training/engine/); the two meet in
training/records.py."""
