"""The run directory on disk, and everything that reads or writes it outside the step.

Modules: `rundir` (what a run writes, `--restart`, config history), `lock` (one writer per
run), `checkpoint` (orbax, the only module that imports it: async saves, sealed steps,
checksums, complete steps), `restore` (a checkpoint read back: the whole state, the newest
intact step, parameters alone), `local_tier` (the node-local checkpoint tier beside the run
directory's), `pinned` (the inputs a run started with), `paths` (output paths checked before
work), `remote` and `sync` (a URL `train.output_dir`: the local mirror, uploads after each
checkpoint), `runmodel` (a trained run's model and tokenizer, for generate and eval).

May import: `kiln.errors`, `kiln.util`, `kiln.data`, `kiln.config`, `kiln.parallel`,
`kiln.losses`, `kiln.model`.

Public names: `runmodel.load_run_model`, `checkpoint.Checkpointer`, `restore.restore`,
`restore.restore_params`, `checkpoint.latest_complete_step`, `lock.RunLock`,
`rundir.RunComplete`, `remote.local_run`.
"""
