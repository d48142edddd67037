"""Paths that may be URLs: `gs://`, `s3://`, `hf://`, `memory://`, ... through fsspec.

A location is a `Path` (local files, and `file://` URLs turned into local paths) or a `str`
URL of another scheme, read through fsspec (a dependency of orbax's `etils[epath]`). fsspec
rather than `etils.epath`: epath knows gs://, s3://, az:// and hf:// only (through these same
fsspec backends when TensorFlow is absent), not file:// or memory://, and has no batched
ranged reads (fsspec's cat_ranges).
Every failure is a KilnError of one line naming the field; a scheme whose fsspec backend is
not installed names the package to install.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from kiln.errors import KilnError, first_line

Location = Path | str
# Schemes kiln documents, with the package that gives fsspec each one (pyproject extras).
EXTRAS = {"gs": "gcs", "gcs": "gcs", "s3": "s3", "hf": "hf"}
PACKAGES = {"gcs": "gcsfs", "s3": "s3fs", "hf": "huggingface_hub"}
OTHER_PACKAGES = {"az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
# Written as a URL: `://` before any '/' (a local path holding `://` further on stays a path).
_URL_LIKE = re.compile(r"^([^/]*)://(.*)$", re.DOTALL)
ALLOWED = (
    "allowed: a local path, file:///absolute/path, or a URL of a scheme fsspec knows with a "
    "path after it (gs://bucket/dir, s3://bucket/dir, hf://..., memory://dir)"
)
LOCAL = "allowed: a local path or file:///absolute/path"


def scheme(path: str) -> str | None:
    """The URL scheme of `path` ('gs', 'file', ...), or None for a plain path."""
    m = _URL.match(str(path))
    return m.group(1).lower() if m else None


def is_remote(loc: Location) -> bool:
    """Whether `loc` is read through fsspec rather than the local filesystem."""
    return isinstance(loc, str) and scheme(loc) not in (None, "file")


def url_problem(path: str) -> str | None:
    """What is wrong with `path` written as a URL (`://` before any '/'), or None: a plain path
    or a URL kiln can read. Refused: no scheme (`://x`), a scheme that is not one (`1x://`), one
    fsspec does not know, no path after the scheme (`gs://`), and a `file://` URL whose path is
    not absolute (`file://relative/runs` names a host `relative`)."""
    m = _URL_LIKE.match(path)
    if m is None:
        return None
    given, rest = m.groups()
    if not given:
        return "no URL scheme before '://'"
    s = scheme(path)
    if s is None:
        return f"{given!r} before '://' is not a URL scheme"
    if s == "file":
        parsed = urlparse(path)
        if parsed.netloc not in ("", "localhost"):
            return (
                f"a file:// URL takes an absolute path (file:///...), but {parsed.netloc!r} "
                "stands where its host would be"
            )
        return None if parsed.path else "the file:// URL names no path"
    if not rest.strip("/"):
        return f"the {s}:// URL names no path after its scheme"
    if not _known_scheme(s):
        return f"fsspec knows no URL scheme {s}://"
    return None


def _known_scheme(s: str) -> bool:
    from fsspec.registry import known_implementations, registry  # only for a URL

    return s in known_implementations or s in registry


def check_url(path: str, allowed: str = ALLOWED) -> str:
    """`path` itself; a ValueError (for a pydantic validator) if it is a malformed URL."""
    problem = url_problem(path)
    if problem is not None:
        raise ValueError(f"{problem}; {allowed}")
    return path


def location(path: str | Path, what: str = "") -> Location:
    """A local Path (`~` expanded, `file://` URLs too) or the URL of another scheme; a
    KilnError naming `what` for a malformed URL (`url_problem`)."""
    if isinstance(path, Path):
        return path.expanduser()
    problem = url_problem(path)
    if problem is not None:
        raise KilnError(f"{what + ': ' if what else ''}{path!r}: {problem}; {ALLOWED}")
    s = scheme(path)
    if s is None:
        return Path(path).expanduser()
    if s == "file":
        return Path(unquote(urlparse(path).path))
    return path.rstrip("/")


def local_dir(value: str | None, field: str) -> str | None:
    """A directory a run writes or resumes on the local filesystem: `file://` URLs become paths,
    other URLs are refused (a ValueError for pydantic, naming what needs a local path)."""
    if value is None or scheme(check_url(value, LOCAL)) is None:
        return value
    loc = location(value)
    if isinstance(loc, Path):
        return str(loc)
    raise ValueError(
        f"a {scheme(value)}:// URL, but {field} needs a local or mounted "
        "filesystem (run lock, metrics.jsonl, TensorBoard events, checkpoint checksums); "
        "allowed: a local path or file:// URL (mount buckets with gcsfuse or mountpoint-s3); "
        "train.output_dir, data inputs, prepared shards, teacher runs and load_params_from may be URLs"
    )


def mirror_root(output_dir: str, mirror_dir: str | None) -> Path:
    """The local directory standing for `output_dir`: itself when local; for a URL, `mirror_dir`
    or `~/.cache/kiln/runs/<hash of the URL>`, where its run directories are mirrored."""
    if scheme(output_dir) in (None, "file"):  # validated: a file:// URL is a path by now
        return Path(output_dir)
    loc = location(output_dir)
    if mirror_dir is not None:
        return Path(mirror_dir).expanduser()
    key = hashlib.sha256(loc.encode()).hexdigest()[:16]
    return Path("~/.cache/kiln/runs").expanduser() / key


def local_or_url(value: str | None) -> str | None:
    """A path that may be a URL: a `file://` URL becomes the path it names, other URLs stay;
    a malformed one is a ValueError (`check_url`)."""
    if value is None or scheme(check_url(value)) != "file":
        return value
    return str(location(value))


def filesystem(url: str, what: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for a URL; KilnError if its backend is missing."""
    import fsspec

    where = url if what in ("", url) else f"{what}: {url}"
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError:
        extra = EXTRAS.get(scheme(url) or "")
        if extra is None:
            package = OTHER_PACKAGES.get(
                scheme(url) or "", f"the fsspec backend of {scheme(url)}://"
            )
            raise KilnError(f"{where} needs {package}, which is not installed") from None
        raise KilnError(
            f"{where} needs {PACKAGES[extra]}, which is not installed (pip install "
            f"'kiln[{extra}]', or pip install {PACKAGES[extra]})"
        ) from None
    except ValueError as e:
        raise KilnError(
            f"{where}: {e}; allowed: local paths and URLs fsspec knows (gs://, s3://, hf://, "
            "file://, memory://)"
        ) from None


def join(loc: Location, *names: str) -> Location:
    """`loc / name / ...` for a Path or a URL."""
    return loc.joinpath(*names) if isinstance(loc, Path) else "/".join((loc, *names))


def name(loc: Location) -> str:
    """The last component of a Path or URL."""
    return loc.name if isinstance(loc, Path) else loc.rstrip("/").rsplit("/", 1)[-1]


@contextlib.contextmanager
def reading(loc: Location, doing: str = "read", what: str = ""):
    """Failures of a local file (OSError) or of a remote store (any exception its backend
    raises, e.g. an HTTP or credentials error) as one KilnError line naming `loc`."""
    caught = OSError if isinstance(loc, Path) else Exception
    try:
        yield
    except KilnError:
        raise
    except caught as e:
        missing = "No such file or directory" if isinstance(e, FileNotFoundError) else None
        reason = getattr(e, "strerror", None) or missing or first_line(e)
        prefix = f"{what}: " if what else ""
        raise KilnError(f"{prefix}cannot {doing} {loc}: {reason}") from None


def is_file(loc: Location) -> bool:
    with reading(loc):
        if isinstance(loc, Path):
            return loc.is_file()
        fs, path = filesystem(loc, loc)
        return fs.isfile(path)


def is_dir(loc: Location) -> bool:
    with reading(loc):
        if isinstance(loc, Path):
            return loc.is_dir()
        fs, path = filesystem(loc, loc)
        return fs.isdir(path)


def size(loc: Location) -> int:
    """Bytes in a file; KilnError naming it if it cannot be read."""
    with reading(loc):
        if isinstance(loc, Path):
            return loc.stat().st_size
        fs, path = filesystem(loc, loc)
        return int(fs.size(path))


def open_read(loc: Location):
    """A binary file object (seekable) for reading a Path or URL."""
    with reading(loc):
        if isinstance(loc, Path):
            return open(loc, "rb")
        fs, path = filesystem(loc, loc)
        return fs.open(path, "rb")


def read_bytes(loc: Location, start: int = 0, end: int | None = None) -> bytes:
    """Bytes [start, end) of a file (end None = to its end)."""
    with reading(loc):
        if isinstance(loc, Path):
            with open(loc, "rb") as fh:
                fh.seek(start)
                return fh.read() if end is None else fh.read(end - start)
        fs, path = filesystem(loc, loc)
        return fs.cat_file(path, start=start or None, end=end)


def identity(loc: Location) -> dict[str, Any]:
    """What a cache or manifest is keyed by: path, size and modification time (ns) of a local
    file; for a URL, its size and the store's version tag (etag, generation or mtime)."""
    with reading(loc):
        if isinstance(loc, Path):
            st = loc.stat()
            return {"path": str(loc), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        fs, path = filesystem(loc, loc)
        info = fs.info(path)
    keys = ("generation", "etag", "ETag", "blob_id", "mtime", "updated", "LastModified", "created")
    version = next((str(info[k]) for k in keys if info.get(k) is not None), None)
    return {"path": loc, "size": int(info["size"]), "version": version}


def expand(pattern: str, what: str) -> list[str]:
    """Files under a URL: a glob, every file below a directory, or the file itself; [] if none."""
    fs, path = filesystem(pattern, what)
    with reading(pattern, "list", what):
        if any(c in path for c in "*?["):
            found = [h for h in fs.glob(path) if fs.isfile(h)]
        elif fs.isdir(path):
            found = [
                h
                for h in fs.find(path)
                if not any(p.startswith(".") for p in h[len(path) :].split("/"))
            ]
        else:
            found = [path] if fs.exists(path) else []
        return sorted(fs.unstrip_protocol(h) for h in found)


def upload(local: Path, url: str, what: str) -> None:
    """Copy the local file `local` to `url`."""
    fs, path = filesystem(url, what)
    with reading(url, "write", what):
        fs.put_file(str(local), path)


def remove(url: str, what: str) -> None:
    """Delete the file at `url`."""
    fs, path = filesystem(url, what)
    with reading(url, "remove", what):
        fs.rm_file(path)


def make_dirs(url: str, what: str) -> None:
    fs, path = filesystem(url, what)
    with reading(url, "create", what):
        fs.makedirs(path, exist_ok=True)


def listdir(loc: Location) -> list[str]:
    """Names in a directory ([] if it does not exist)."""
    with reading(loc, "list"):
        if isinstance(loc, Path):
            return sorted(p.name for p in loc.iterdir()) if loc.is_dir() else []
        fs, path = filesystem(loc, loc)
        if not fs.isdir(path):
            return []
        return sorted(h.rstrip("/").rsplit("/", 1)[-1] for h in fs.ls(path, detail=False))
