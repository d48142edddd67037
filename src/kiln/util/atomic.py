"""A file written whole or not at all, even when a signal ends the process mid-write."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.util.interrupt import on_interrupt


def write_whole(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file beside it, renamed into place:
    a failure, an exception or an interrupt (`kiln.util.interrupt`) leaves no partial `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    forget = on_interrupt(lambda: tmp.unlink(missing_ok=True))
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        forget()
