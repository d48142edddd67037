"""What each `kiln` command does, once `kiln.cli` has parsed its arguments.

Modules: `handlers` (one `cmd_*` per command; each imports what it runs only when it runs, so
`kiln --help`, bad arguments and `kiln prepare` never load JAX), `compile` and `fit` (`kiln
compile`: the step compiled ahead of time, memory fit searches), `buffers` (`--peak-buffers`:
XLA's dump of the compiled step), `hlo` (XLA's HLO text and dumps read: collectives, peak
buffers), `generate`, `evaluate` (`kiln eval`), `hf` (`kiln export-hf` / `import-hf`; each
family's format is in `kiln.model`), `compare` (`kiln compare`).

May import: every layer below it; only `kiln.cli` imports this package.

Public names: `generate.generate`, `generate.run_generate`, `evaluate.run_eval`,
`compile.compile_report`, `hlo.collectives`, `fit.fit`, `hf.export_hf`, `hf.import_hf`, `compare.compare`.
"""
