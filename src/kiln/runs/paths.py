"""Directories a run will write, checked before any work: a path that cannot be created (a
file in the way, a read-only or pseudo filesystem) is bad input, refused in one line."""

from __future__ import annotations

from pathlib import Path

from kiln.config import Config
from kiln.util import storage
from kiln.util.files import check_creatable, check_path_length

# Sources tokenized into data.cache_dir on first use.
_CACHED_SOURCES = ("text", "jsonl", "parquet")
# Bytes of path kept free below a run directory for the files kiln writes there (the deepest,
# a checkpoint's data files, take about 100).
RUN_DIR_RESERVE = 256


def check_output_paths(config: Config) -> None:
    """KilnError naming the field if the run directory or the data cache cannot be written."""
    output_dir = config.local_output_dir.expanduser()
    if storage.is_remote(storage.location(config.train.output_dir)):
        storage.filesystem(config.train.output_dir, "train.output_dir")  # its backend is there
        check_creatable(output_dir, "train.mirror_dir")
    else:
        check_creatable(output_dir, "train.output_dir")
    run_dir = output_dir / config.train.run_name
    check_path_length(run_dir, "train.output_dir/train.run_name", RUN_DIR_RESERVE)
    if run_dir.exists() or run_dir.is_symlink():
        check_creatable(run_dir, "train.run_name")
    if config.checkpoint.local_dir is not None:  # node-local: every process probes its own
        check_creatable(
            Path(config.checkpoint.local_dir).expanduser() / config.train.run_name,
            "checkpoint.local_dir",
        )
    if any(s.source in _CACHED_SOURCES for _, s in config.data.mixture()):
        cache = config.data.cache_dir
        root = Path(cache).expanduser() if cache else output_dir / ".cache"
        if not root.is_dir():  # an existing cache may be read-only: prepared data is only read
            check_creatable(root, "data.cache_dir" if cache else "data.cache_dir (default)")
