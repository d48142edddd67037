"""Evaluation: `kiln eval` on a run's checkpoint, and `train.eval_tasks` during training.

tasks.py parses task strings and reads their data (no JAX, so the config schema can check task
strings); scoring.py runs them on the mesh; command.py is `kiln eval`.
"""
