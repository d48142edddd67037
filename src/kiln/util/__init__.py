"""Small helpers every layer uses, with no kiln dependency but `kiln.errors`.

Modules: `storage` (files at local paths or URLs through fsspec: read, list, upload, the local
mirror of a URL), `files` (output directories checked writable, arrays written so a full disk
keeps its errno), `atomic` (files written whole), `scratch` (output directories staged and
renamed into place, temporary directories; removed however a command ends), `checksums` (CRC-32
of files and trees), `humanize` (counts and plurals in words), `interrupt` (SIGINT/SIGTERM as
one clean exit, exit codes 128 + the signal), `platforms` (which accelerators are attached, from
their device files; JAX's CPU backend when none is; `import kiln` runs it, and it imports nothing
of kiln).

May import: `kiln.errors`. Imports no JAX.

Public names: the modules above; `storage.Location`, `storage.is_remote`, `storage.filesystem`,
`checksums.crc32_of`, `humanize.count`, `humanize.plural`, `interrupt.exit_on_signals`,
`scratch.check_stageable`, `scratch.staged`, `scratch.temporary_directory`,
`platforms.tpu_attached`, `platforms.cpu_unless_attached`, `platforms.cpu_by_default`.
"""
