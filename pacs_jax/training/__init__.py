"""The trainer (pacs_jax/train.py): two roles, the rollout engine (engine/) and the learner (learner/),
joined by the records they hand each other (records.py) and scheduled by rollout.py; the step's programs
(step_programs.py), the loop (loop.py) and the run (run.py) above them; the spec, memory check, progress,
signals and workdir shared below."""
