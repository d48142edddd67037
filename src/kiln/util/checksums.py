"""Integrity of checkpoints: checksums of their files (a manifest written last, checked before a
restore), and checks of the arrays restored (names, shapes, finite values).

`checkpoints/<step>/kiln_manifest.json` lists every file of the step (path relative to the step
directory, size, CRC-32). CRC-32 (zlib, ~4 GB/s on one core here, and it releases the GIL)
detects every error burst of up to 32 bits, so any flipped byte or short run of bytes, and
almost surely anything larger; it guards against damage, not against tampering. The manifest
is written only once orbax has committed the step, through a temporary file and a rename, so
its presence also says the save finished.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from kiln.errors import KilnError

MANIFEST = "kiln_manifest.json"
VERSION = 1
_CHUNK = 8 << 20


class CheckpointDamaged(KilnError):
    """A checkpoint whose files are not those that were written (or never finished)."""


def crc32_of(path: Path) -> int:
    """CRC-32 of a file's bytes, read in chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def step_files(step_dir: Path) -> list[str]:
    """Every regular file under a step directory (POSIX paths relative to it), manifest excluded."""
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = (Path(root) / name).relative_to(step_dir).as_posix()
            if rel != MANIFEST and not name.startswith(f".{MANIFEST}"):
                out.append(rel)
    return sorted(out)


def write_manifest(step_dir: Path) -> int:
    """Checksum every file of `step_dir` into its manifest (atomically); returns the bytes read."""
    files, total = {}, 0
    for rel in step_files(step_dir):
        path = step_dir / rel
        files[rel] = {"bytes": path.stat().st_size, "crc32": f"{crc32_of(path):08x}"}
        total += files[rel]["bytes"]
    tmp = step_dir / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({"version": VERSION, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MANIFEST)
    fd = os.open(step_dir, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)
    return total


def has_manifest(step_dir: Path) -> bool:
    return (step_dir / MANIFEST).is_file()


def verify(step_dir: Path, *, checksums: bool = True) -> int:
    """CheckpointDamaged unless every file the manifest lists is there with its size (and, with
    `checksums`, its CRC-32); returns the bytes checksummed."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
        files = manifest["files"]
        if manifest["version"] != VERSION or not isinstance(files, dict):
            raise ValueError(f"version {manifest['version']!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointDamaged(f"{MANIFEST} is unreadable ({e})") from None
    total = 0
    for rel, want in sorted(files.items()):
        path = step_dir / rel
        try:
            size = path.stat().st_size
        except OSError:
            raise CheckpointDamaged(f"{rel} is missing") from None
        if size != want["bytes"]:
            raise CheckpointDamaged(f"{rel} has {size} bytes, {want['bytes']} were written")
        if checksums:
            if f"{crc32_of(path):08x}" != want["crc32"]:
                raise CheckpointDamaged(f"{rel} does not match its checksum")
            total += size
    return total


def leaf_names(tree) -> list[str]:
    """orbax's names of a pytree's leaves: the keys of their paths, joined by dots."""
    import jax  # not at import time: `kiln prepare` forks workers only without JAX loaded

    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = (next(str(getattr(k, a)) for a in ("key", "idx", "name") if hasattr(k, a)) for k in path)  # fmt: skip
        names.append(".".join(keys))
    return names


def check_shapes(saved: dict[str, tuple[int, ...]], abstract, prefix: str = "") -> None:
    """KilnError naming the first array of `abstract` (under `prefix`) the checkpoint lacks."""
    import jax  # not at import time: `kiln prepare` forks workers only without JAX loaded

    for name, leaf in zip(leaf_names(abstract), jax.tree.leaves(abstract), strict=True):
        name = prefix + name
        if name not in saved:
            raise KilnError(f"has no array {name}")
        if saved[name] != tuple(leaf.shape):
            raise KilnError(f"{name} has shape {saved[name]}, this model {tuple(leaf.shape)}")


def non_finite_leaf(tree) -> str | None:
    """Name of the first floating-point leaf holding a NaN or an infinity, if any."""
    import jax  # not at import time: `kiln prepare` forks workers only without JAX loaded
    import jax.numpy as jnp

    for name, leaf in zip(leaf_names(tree), jax.tree.leaves(tree), strict=True):
        if jnp.issubdtype(leaf.dtype, jnp.floating) and not bool(jnp.isfinite(leaf).all()):
            return name
    return None


def damaged(directory: Path, step: int, reason: str) -> KilnError:
    """The error for a damaged checkpoint that has no fallback."""
    return CheckpointDamaged(f"checkpoint {Path(directory) / str(step)} is damaged: {reason}")


def set_aside(directory: Path, steps: list[int]) -> list[Path]:
    """Move damaged step directories out of `directory` (to `../damaged-checkpoints/`), so that
    the run saves those steps anew; returns where they went."""
    moved = []
    for step in steps:
        src = Path(directory) / str(step)
        if not src.exists():
            continue
        dest_root = Path(directory).parent / "damaged-checkpoints"
        dest_root.mkdir(exist_ok=True)
        dest, n = dest_root / str(step), 1
        while dest.exists():
            dest, n = dest_root / f"{step}.{n}", n + 1
        os.replace(src, dest)
        moved.append(dest)
    return moved
