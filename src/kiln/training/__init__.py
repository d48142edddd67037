"""Training: the objective seam, exact accumulation, the pure step, and the loop around it.

Modules: `objective` (the `Objective` protocol and `LMObjective`), `train` (TrainState,
loss-and-grads with gradient accumulation, `make_step`, the update), `batches` (a global batch
placed on the mesh, its micro-batches, its load-balanced order), `optim` (optimizer and
schedule), `loop` (steps, checkpoints, evaluation, signals), `metrics`, `console`, `tracking`
(TensorBoard, metrics.jsonl, Weights & Biases), `profiling`, `watchdog` (a run whose steps stop
finishing exits to be restarted), `goodput` (where a run's wall time went, over its attempts),
`scoring` (eval tasks on the mesh), `resume` (may this config continue its run), `runner`
(start-up shared by every command that trains) and `pretrain` (`kiln train`).

May import: every layer below: `kiln.errors`, `kiln.util`, `kiln.data`, `kiln.config`,
`kiln.parallel`, `kiln.losses`, `kiln.model`, `kiln.runs`.

Public names: `train.TrainState`, `objective.Objective`, `objective.LMObjective`,
`train.make_step`, `train.loss_and_grads`, `train.run_objective`, `train.init_state`,
`batches.place_batch`, `runner.execute`, `pretrain.run`, `scoring.Evaluator`.
"""
