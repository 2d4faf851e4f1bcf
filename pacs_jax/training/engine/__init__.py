"""The rollout engine's role in a training step: its programs (sampler calls, assembly, dynamic sampling's
selection), the collection of a step's rows (sampling, scoring, dynamic sampling), carry-over's trainer
side and the weights' copy it samples from one step off. It reads the learner's parameters as arguments
and never imports the learner (training/learner/); the two meet in training/records.py."""
