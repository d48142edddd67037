"""A run whose `train.output_dir` is a URL: kiln works in a local mirror and syncs it with the URL.

The run lock (flock), appends to metrics.jsonl, TensorBoard event files, orbax's
rename-into-place and kiln's checkpoint checksums all need a local filesystem, so the run
directory is a local mirror (`storage.mirror_root`). At start-up the mirror is brought up to
date from the URL (`pull`); after every sealed checkpoint and at the end of the run the files
that are new or changed locally are uploaded (`push`). A checkpoint's files go up before its
manifest, and a step on the URL without a manifest is never fetched, so a URL holding a
half-uploaded checkpoint never shows it as complete: the rule of `checkpoint.complete_steps`.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

from kiln.errors import KilnError
from kiln.runs.lock import LOCK_NAME
from kiln.util import storage
from kiln.util.checksums import MANIFEST

FIELD = "train.output_dir"
# Local only: a moved-aside damaged step, the lock, data and compile caches, orbax temporaries.
_LOCAL_DIRS = ("damaged-checkpoints",)
_STEP = re.compile(r"^checkpoints/(\d+)/(.+)$")
# Files this small are fetched at every start (metrics.jsonl or config.yaml may change and keep
# their size); larger ones (checkpoint arrays, written once) only when their size differs.
_ALWAYS_BYTES = 1 << 20


def _local_only(rel: str) -> bool:
    parts = rel.split("/")
    return (
        parts[0] in _LOCAL_DIRS
        or rel == LOCK_NAME
        or any(p.startswith(".") or ".orbax-checkpoint-tmp" in p for p in parts)
    )


def _ordered(rels: list[str]) -> list[str]:
    """Checkpoint files by step, each step's manifest after its other files; then the rest."""

    def key(rel: str):
        m = _STEP.match(rel)
        if m:
            return (0, int(m[1]), m[2] == MANIFEST, rel)
        return (1, 0, False, rel)

    return sorted(rels, key=key)


def _complete(rel: str, manifests: set[str]) -> bool:
    """Whether `rel` is outside checkpoints/<step>/ or its step has a manifest."""
    m = _STEP.match(rel)
    return m is None or f"checkpoints/{m[1]}/{MANIFEST}" in manifests


def _newest(manifests) -> int:
    """The newest step among checkpoint manifest paths (-1 if none)."""
    steps = [Path(m).parent.name for m in manifests]
    return max((int(s) for s in steps if s.isdigit()), default=-1)


class RunSync:
    """The link between the local run directory `local` and its URL `url`."""

    def __init__(self, url: str, local: Path):
        self.url, self.local = url, Path(local)
        self.fs, self.path = storage.filesystem(url, FIELD)
        self._sent: dict[str, tuple[int, int]] = {}  # rel -> local (size, mtime_ns) on the URL
        self._lock = threading.Lock()
        self._dirs: set[str] = set()  # directories made on the URL
        self.uploaded = 0  # files uploaded
        self.fetched = 0  # files fetched at start-up

    def pull(self) -> int:
        """Fetch what the URL holds into the mirror; returns the number of files fetched.

        Files only the mirror has are kept (a checkpoint not yet uploaded is uploaded later);
        steps whose manifest is not on the URL (an upload that was cut) are not fetched.
        """
        with storage.reading(self.url, "read", FIELD):
            if not self.fs.isdir(self.path):
                return 0
            found = self.fs.find(self.path, detail=True)
        remote = {
            h[len(self.path) :].lstrip("/"): int(info["size"])
            for h, info in found.items()
            if info.get("type", "file") == "file"
        }
        manifests = {r for r in remote if r.endswith(f"/{MANIFEST}")}
        # A mirror whose newest sealed step the URL lacks (killed before its upload) is ahead:
        # its logs and config are kept, to be uploaded at the next sync.
        ahead = _newest(self.local.glob(f"checkpoints/*/{MANIFEST}")) > _newest(manifests)
        fetched = 0
        for rel in _ordered([r for r in remote if _complete(r, manifests)]):
            if _local_only(rel) or (ahead and not _STEP.match(rel)):
                continue
            dest, size = self.local / rel, remote[rel]
            if not (size > _ALWAYS_BYTES and dest.is_file() and dest.stat().st_size == size):
                dest.parent.mkdir(parents=True, exist_ok=True)
                part = dest.with_name(f".{dest.name}.part-{os.getpid()}")
                with storage.reading(f"{self.url}/{rel}", "read", FIELD):
                    self.fs.get_file(f"{self.path}/{rel}", str(part))
                os.replace(part, dest)
                fetched += 1
            st = dest.stat()
            self._sent[rel] = (st.st_size, st.st_mtime_ns)
        return fetched

    def push(self) -> None:
        """Upload new and changed files of the mirror, checkpoint manifests last; delete on the
        URL what the mirror no longer has (old checkpoints), manifests first. KilnError (one
        line) if the store refuses."""
        with self._lock:
            local: dict[str, tuple[int, int]] = {}
            if self.local.is_dir():
                for p in self.local.rglob("*"):
                    rel = p.relative_to(self.local).as_posix()
                    if p.is_file() and not _local_only(rel):
                        st = p.stat()
                        local[rel] = (st.st_size, st.st_mtime_ns)
            manifests = {r for r in local if r.endswith(f"/{MANIFEST}")}
            gone = [r for r in self._sent if r not in local]
            for rel in sorted(gone, key=lambda r: not r.endswith(f"/{MANIFEST}")):
                target = f"{self.url}/{rel}"
                with storage.reading(target, "remove", FIELD):
                    self.fs.rm_file(f"{self.path}/{rel}")
                del self._sent[rel]
            for rel in _ordered([r for r in local if _complete(r, manifests)]):
                if self._sent.get(rel) == local[rel]:
                    continue
                parent = f"{self.path}/{rel}".rsplit("/", 1)[0]
                if parent not in self._dirs:  # object stores have none; local:// and sftp do
                    with storage.reading(f"{self.url}/{rel}", "write", FIELD):
                        self.fs.makedirs(parent, exist_ok=True)
                    self._dirs.add(parent)
                storage.upload(self.local / rel, f"{self.url}/{rel}", FIELD)
                self._sent[rel] = local[rel]
                self.uploaded += 1


def start(config) -> RunSync | None:
    """For a URL `train.output_dir`: the sync of this run, its mirror brought up to date first
    (None for a local output_dir). KilnError (one line) for several processes: each host would
    mirror only the checkpoint shards it wrote."""
    url = storage.location(config.train.output_dir)
    if not storage.is_remote(url):
        return None
    import jax

    if jax.process_count() > 1:
        raise KilnError(
            f"{FIELD}: {url} is a URL, which kiln mirrors locally on one process only, and this "
            f"run has {jax.process_count()}; allowed with several processes: a path every host "
            "mounts (gcsfuse, mountpoint-s3, NFS)"
        )
    sync = RunSync(storage.join(url, config.train.run_name), config.run_dir)
    sync.fetched = sync.pull()
    return sync
